"""A hybrid model (full-attention and 64-token sliding-window layers alternating, as Gemma 3
and gpt-oss interleave them) in vLLM's push flow with KvxferPushConnector, vLLM's hybrid KV
cache manager on: each kind of layer has a KV cache group with its own block ids, a layer of
each group laid over the same memory. The decode names each group's blocks; the prefill
writes its blocks of each group at the same positions, through that group's layers only.
The prefill stops before the last prompt token, which the decode computes, so that no block
the decode's window reads is freed. One pair of engines (UCX), several cases."""

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import HYBRID_MODEL
from flows import BLOCK, assert_same_output, decode, prompt
from harness import Engine
from push_flows import assert_pushed_kv_of_another_prompt_changes_the_output, handoff, push_pair

WINDOW = 64
# vLLM's group order for this model: full attention (layers 0, 2), sliding window (1, 3).
GROUP_OF_LAYER = {0: 0, 1: 1, 2: 0, 3: 1}


@pytest.fixture(scope="module")
def push_hybrid_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Engine, int]]:
    yield from push_pair(tmp_path_factory, "push-hybrid", HYBRID_MODEL)


def written_blocks(params: dict[str, Any], n: int) -> dict[int, list[int]]:
    """Per group, the prefill's blocks that the first `n - 1` tokens fill whole (the decode
    computes token `n - 1` into the last partial block), without the null blocks of freed
    out-of-window ones: what the decode must now hold byte for byte."""
    groups = params["remote_block_ids"]
    assert len(groups) == 2, params
    full = (n - 1) // BLOCK
    return {g: [b for b in ids[:full] if b != 0] for g, ids in enumerate(groups)}


def test_every_group_is_written_byte_identical_and_the_first_token_equals_a_local_run(
    push_hybrid_engines: tuple[Engine, Engine, int],
) -> None:
    """Concurrent prompts below and above the window; 95 tokens: the window of the token
    the decode computes (94) starts at token 30, in block 0, which neither side frees. One
    token each: as the decode generates more, its window frees blocks that vLLM hands to
    other requests at once, so the cache is compared after the first."""
    p, d, port = push_hybrid_engines
    lengths = [40, 95, 150, 257]
    xs = [prompt(140 + i, n) for i, n in enumerate(lengths)]
    before = d.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    p_out, remote = handoff(p, d, port, xs, xs, timeout=240, max_tokens=1)
    # All but the last prompt token came from the prefill: the decode computed that one.
    assert d.call({"op": "external_tokens"}) - external == sum(lengths) - len(lengths)
    p_blocks = p.call({"op": "kv_hashes"})
    after = d.call({"op": "kv_hashes"})
    for n, out in zip(lengths, p_out, strict=True):
        params = out["params"]
        assert params["remote_num_tokens"] == n - 1, params
        blocks = written_blocks(params, n)
        # The sliding-window group holds only the blocks its window reads.
        assert len(blocks[1]) == (n - 1) // BLOCK - max(0, n - WINDOW) // BLOCK, (n, params)
        for layer, group in GROUP_OF_LAYER.items():
            for block in blocks[group]:
                h = p_blocks[str(layer)][str(block)]
                assert h in after[str(layer)].values(), f"{n}: layer {layer} block {block}"
                assert h not in before[str(layer)].values(), f"{n}: layer {layer} {block} was there"
    local = d.call(
        {
            "op": "generate",
            "max_tokens": 1,
            "requests": [{"prompt": x, "params": None} for x in xs],
        }
    )
    for r, q in zip(remote, local, strict=True):
        assert_same_output(r, q)


def test_concurrent_requests_generate_what_a_local_run_does(
    push_hybrid_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_hybrid_engines
    xs = [prompt(160 + i, n) for i, n in enumerate([33, 64, 96, 200])]
    _, remote = handoff(p, d, port, xs, xs, timeout=240)
    local = decode(d, xs, [None] * len(xs))
    for r, q in zip(remote, local, strict=True):
        assert_same_output(r, q)


def test_kv_of_another_prompt_changes_the_output(
    push_hybrid_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_hybrid_engines
    assert_pushed_kv_of_another_prompt_changes_the_output(p, d, port, 150)
