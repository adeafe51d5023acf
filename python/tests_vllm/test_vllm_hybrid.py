"""A hybrid model (full-attention and 64-token sliding-window layers alternating, as Gemma 3
and gpt-oss interleave them) in a real vLLM: its hybrid KV cache manager gives each kind a KV
cache group with its own block ids, and lays a layer of each group over the same memory.
KvxferConnector moves every group, each by its own blocks (a sliding-window group only the
blocks its window still reads); the prefill stops before the last prompt token, which the
decode computes, so that no block the decode's window reads is freed. Both run with content
digests on: every load is checked against the digests the prefill published."""

from typing import Any

from flows import (
    BLOCK,
    assert_kv_of_another_prompt_changes_the_output,
    assert_same_output,
    decode,
    kvxfer_metrics,
    prefill,
    prompt,
)
from harness import Engine

WINDOW = 64
# vLLM's group order for this model: full attention (layers 0, 2), sliding window (1, 3).
GROUP_OF_LAYER = {0: 0, 1: 1, 2: 0, 3: 1}


def full_blocks(ids: list[int], prompt_len: int) -> list[int]:
    """The blocks of a group's tail list that the prompt fills (the last may be partial:
    the decode recomputes the last prompt token into it)."""
    return ids[:-1] if prompt_len % BLOCK else ids


def test_every_group_arrives_byte_identical_below_and_above_the_window(
    hybrid_engines: tuple[Engine, Engine, Engine],
) -> None:
    p, d, _ = hybrid_engines
    lengths = [40, 100, 150, 257]  # the first fits the window; none ends where it slides off
    xs = [prompt(40 + i, n) for i, n in enumerate(lengths)]
    params = prefill(p, xs)
    for n, q in zip(lengths, params, strict=True):
        full, sliding = q["remote_block_ids"]
        # The prefill computed all but the last token. Full attention: every block; sliding
        # window: those the window of the token the decode computes (n - 1) reads.
        assert q["remote_num_tokens"] == n - 1, q
        assert len(full) == -(-(n - 1) // BLOCK), (n, q)
        assert len(sliding) == -(-(n - 1) // BLOCK) - max(0, n - WINDOW) // BLOCK, (n, q)
    p_blocks = p.call({"op": "kv_hashes"})
    before = d.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    before_metrics = kvxfer_metrics(d)
    remote = decode(d, xs, params)
    # All but the last prompt token, which the decode computes (its window's blocks kept).
    assert d.call({"op": "external_tokens"}) - external == sum(lengths) - len(lengths)
    after_metrics = kvxfer_metrics(d)
    for key, grew in [("failed_setups", 0), ("digest_mismatches", 0), ("verified_digests", 4)]:
        name = f"vllm:kvxfer_{key}"
        assert after_metrics.get(name, 0) - before_metrics.get(name, 0) == grew, key
    after = d.call({"op": "kv_hashes"})
    for n, q in zip(lengths, params, strict=True):
        for layer, group in GROUP_OF_LAYER.items():
            for block in full_blocks(q["remote_block_ids"][group], n - 1):
                h = p_blocks[str(layer)][str(block)]
                assert h in after[str(layer)].values(), f"layer {layer}: block {block} missing"
                assert h not in before[str(layer)].values(), f"layer {layer}: {block} was there"
    local = decode(d, xs, [None] * len(xs))
    for r, q in zip(remote, local, strict=True):
        assert_same_output(r, q)


def test_kv_of_another_prompt_changes_the_output(
    hybrid_engines: tuple[Engine, Engine, Engine],
) -> None:
    p, d, _ = hybrid_engines
    assert_kv_of_another_prompt_changes_the_output(p, d, 50, 150)


def test_a_window_starting_on_a_block_the_prefill_would_free_loads_whole(
    hybrid_engines: tuple[Engine, Engine, Engine],
) -> None:
    """A 95-token prompt: the decode computes token 94, whose window starts at token 31,
    the last of block 0. A prefill that computed all 95 tokens frees tokens up to 31 (its
    next token's window starts at 32); this one stops at 94 tokens, so block 0 is still
    held: every block moves and nothing is recomputed. (Loading all 95 tokens, vLLM's
    decode freed block 0 itself and token 94 attended to its null block: logprobs off by
    0.005.)"""
    p, d, _ = hybrid_engines
    x = prompt(60, 95)
    (params,) = prefill(p, [x])
    assert len(params["remote_block_ids"][1]) == 3, params
    before: dict[str, Any] = kvxfer_metrics(d)
    external = d.call({"op": "external_tokens"})
    (out,) = decode(d, [x], [params])
    assert d.call({"op": "external_tokens"}) - external == 94
    (local,) = decode(d, [x], [None])
    assert_same_output(out, local)
    after = kvxfer_metrics(d)
    assert after.get("vllm:kvxfer_failed_setups", 0) == before.get("vllm:kvxfer_failed_setups", 0)


def test_a_stock_peer_is_refused_by_name_and_the_prompt_computed_both_ways(
    hybrid_engines: tuple[Engine, Engine, Engine],
) -> None:
    """kvxfer pairs hybrid models with kvxfer peers only: between a kvxfer engine and one
    running vLLM's own NixlConnector, each direction fails the load (the reason named on the
    kvxfer side) and the decode computes the prompt itself, never from the other's KV."""
    p, d, stock = hybrid_engines
    x = prompt(61, 150)
    # A stock prefill's params at a kvxfer decode.
    external = d.call({"op": "external_tokens"})
    (out,) = decode(d, [x], prefill(stock, [x]))
    assert d.call({"op": "external_tokens"}) == external, "a stock prefill's KV was loaded"
    (local,) = decode(d, [x], [None])
    assert_same_output(out, local)
    failures = [line for line in d.log_text().splitlines() if "kvxfer: load of" in line]
    assert failures and "is a stock vLLM prefill" in failures[-1], failures
    # A kvxfer prefill's params at a stock decode.
    external = stock.call({"op": "external_tokens"})
    (out,) = decode(stock, [x], prefill(p, [x]), timeout=180)
    assert stock.call({"op": "external_tokens"}) == external, "a kvxfer prefill's KV was loaded"
    (local,) = decode(stock, [x], [None])
    assert_same_output(out, local)
