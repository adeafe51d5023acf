"""A Nemotron-H (Mamba2 layers beside attention layers) in vLLM's push flow with
KvxferPushConnector: a KV cache group of Mamba state pages (one running state per request,
padded to the attention block) and one of attention KV, laid over the same memory. The
prefill stops before the last prompt token and writes each Mamba layer's state page whole
and the attention blocks by position; the decode computes the last token itself and must
generate what it generates computing the whole prompt. One pair of engines (UCX)."""

import time
from collections.abc import Iterator

import pytest
from flows import BLOCK, assert_same_output, decode, prompt
from harness import NEMOTRON_MODEL, Engine
from push_flows import (
    assert_pushed_kv_of_another_prompt_changes_the_output,
    handoff,
    push_metrics,
    push_pair,
)

# make_model.py's `nemotron-h`: Mamba, attention, Mamba, attention.
STATE_LAYERS, ATTENTION_LAYERS = (0, 2), (1, 3)
# vLLM's group order for it: the Mamba group, then the attention group.
STATE_GROUP, ATTENTION_GROUP = 0, 1
# An attention block (2 KV heads x 32 tokens x (K + V of 64) x fp32); vLLM pads each state
# page to it, and the padding moves too.
PAGE = 2 * BLOCK * 2 * 64 * 4


@pytest.fixture(scope="module")
def push_mamba_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Engine, int]]:
    yield from push_pair(tmp_path_factory, "push-mamba-hybrid", NEMOTRON_MODEL)


def test_state_pages_and_attention_blocks_are_written_and_outputs_equal_a_local_run(
    push_mamba_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_mamba_engines
    lengths = [12, 100, 161, 300]  # 300: past the 256-token scan chunk
    xs = [prompt(190 + i, n) for i, n in enumerate(lengths)]
    before = d.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    written = push_metrics(p).get("vllm:kvxfer_push_bytes", 0)
    p_out, remote = handoff(p, d, port, xs, xs, timeout=240)
    # All but the last prompt token came from the prefill: the decode computed that one.
    assert d.call({"op": "external_tokens"}) - external == sum(lengths) - len(lengths)
    # Per request: each Mamba layer's page, each attention layer's blocks; nothing else.
    blocks = sum(-(-(n - 1) // BLOCK) for n in lengths)
    expected = (len(xs) * len(STATE_LAYERS) + blocks * len(ATTENTION_LAYERS)) * PAGE
    deadline = time.monotonic() + 30
    while push_metrics(p).get("vllm:kvxfer_push_bytes", 0) - written < expected:
        assert time.monotonic() < deadline, push_metrics(p)
        time.sleep(0.1)
    assert push_metrics(p)["vllm:kvxfer_push_bytes"] - written == expected
    # The attention blocks the prefill filled are, byte for byte, in the decode's cache (the
    # state pages the decode updates in place as it computes).
    p_blocks = p.call({"op": "kv_hashes"})
    after = d.call({"op": "kv_hashes"})
    for n, out in zip(lengths, p_out, strict=True):
        params = out["params"]
        assert params["remote_num_tokens"] == n - 1, params
        ids = params["remote_block_ids"][ATTENTION_GROUP]
        for layer in ATTENTION_LAYERS:
            for block in ids[: (n - 1) // BLOCK]:
                h = p_blocks[str(layer)][str(block)]
                assert h in after[str(layer)].values(), f"{n}: layer {layer} block {block}"
                assert h not in before[str(layer)].values(), f"{n}: layer {layer} {block} was there"
    local = decode(d, xs, [None] * len(xs))
    for r, q in zip(remote, local, strict=True):
        assert_same_output(r, q)


def test_state_and_kv_of_another_prompt_change_the_output(
    push_mamba_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_mamba_engines
    assert_pushed_kv_of_another_prompt_changes_the_output(p, d, port, 200)
