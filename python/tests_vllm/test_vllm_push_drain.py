"""A push room its decode aborts while the prefill is writing, shown in real engines: the
prefill (a gated KvxferPushConnector, `gated_connectors`) has written the first layer of a
960-token prompt into the decode's blocks and holds the next one in its forward pass until
the test opens the gate; the decode aborts the request meanwhile. The prefill rank learns of
the abort between layers (its idle poll), releases its WRITEs and acknowledges, and refuses
the layers still to come; only then does the decode give the blocks back. The decode's KV
cache fits one such request, so the next request waiting there runs in the aborted one's
blocks while the prefill is still computing its prompt: no byte of that prompt's later
layer may reach the decode, and the next request must generate what a local run does."""

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _usable_or_skip, running
from flows import DECODE_TOKENS, assert_same_output, decode, prompt
from harness import Engine, free_port
from push_flows import PUSH, push_params

GATED = ("GatedPushConnector", "gated_connectors")
# 45 blocks of 32 tokens: a 960-token request holds 30, the next one needs 31.
BLOCKS = 45
_ids = itertools.count()


@pytest.fixture(scope="module")
def drain_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Engine, int, Path]]:
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-push-drain")
    gate = logdir / "gate"
    port = free_port()
    extra = {"transport": "ucx", "bootstrap_timeout": 10.0, "waiting_timeout": 90.0}
    with running(
        [
            Engine(
                "prefill-gated",
                "0",
                {**extra, "side_channel_port": port},
                logdir,
                connector=GATED,
                env={"KVXFER_TEST_GATE": str(gate)},
            ),
            Engine(
                "decode-small",
                "1",
                {**extra, "side_channel_port": free_port()},
                logdir,
                connector=PUSH,
                opts={"num_blocks": BLOCKS},
            ),
        ],
        logdir,
    ) as (p, d):
        yield p, d, port, gate


def test_an_aborted_rooms_blocks_serve_the_next_request_only_once_the_writes_stopped(
    drain_engines: tuple[Engine, Engine, int, Path],
) -> None:
    p, d, port, gate = drain_engines
    x, y = prompt(230, 960), prompt(231, 960)
    rid, other = f"drain-{next(_ids)}", f"next-{next(_ids)}"
    d.send(
        {
            "op": "generate",
            "max_tokens": DECODE_TOKENS,
            "requests": [
                {
                    "id": rid,
                    "prompt": x,
                    "params": push_params(port, rid),
                    "on_transferring": "abort",
                },
                {"id": other, "prompt": y, "params": None},
            ],
        }
    )
    # The prefill gets the request once it holds the decode's room, so that its first step
    # streams.
    deadline = time.monotonic() + 60
    while not p.call({"op": "push_room_ready", "id": rid}):
        assert time.monotonic() < deadline, "the decode's room never reached the prefill"
        time.sleep(0.01)
    p.send(
        {
            "op": "generate",
            "max_tokens": 1,
            "requests": [{"id": rid, "prompt": x, "params": {"do_remote_decode": True}}],
        }
    )
    # The prefill wrote layer 0 and holds layer 1; the decode saw the room transferring and
    # aborted the request; the prefill acknowledged, and the next request ran.
    time.sleep(3)
    opened = time.monotonic()
    gate.touch()
    aborted, nxt = d.wait(180)
    (p_out,) = p.wait(180)
    assert aborted["finish"] == "aborted", aborted
    # The next request did not wait for the prefill's forward pass: the prefill had stopped
    # writing into those blocks when it acknowledged the abort.
    assert nxt["first_token"] < opened, "the next request waited for the prefill's forward pass"
    # Not one block of the aborted prompt's layer 1 reached the decode (its layer 0 did,
    # before the abort); the prefill's blocks of it are those it names.
    p_blocks, after = p.call({"op": "kv_hashes"}), d.call({"op": "kv_hashes"})
    x_blocks = p_out["params"]["remote_block_ids"]
    assert len(x_blocks) == 30, p_out["params"]
    late = [b for b in x_blocks if p_blocks["1"][str(b)] in after["1"].values()]
    assert not late, f"the prefill's layer-1 blocks {late} of the aborted prompt reached the decode"
    refused = [line for line in p.log_text().splitlines() if "layer write failed" in line]
    assert refused and "is Failed" in refused[-1], refused
    (local,) = decode(d, [y], [None])
    assert_same_output(nxt, local)
