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
    hybrid_engines: tuple[Engine, Engine, Engine, Engine],
) -> None:
    p, d, _, _ = hybrid_engines
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
    hybrid_engines: tuple[Engine, Engine, Engine, Engine],
) -> None:
    p, d, _, _ = hybrid_engines
    assert_kv_of_another_prompt_changes_the_output(p, d, 50, 150)


def test_a_window_starting_on_a_block_the_prefill_would_free_loads_whole(
    hybrid_engines: tuple[Engine, Engine, Engine, Engine],
) -> None:
    """A 95-token prompt: the decode computes token 94, whose window starts at token 31,
    the last of block 0. A prefill that computed all 95 tokens frees tokens up to 31 (its
    next token's window starts at 32); this one stops at 94 tokens, so block 0 is still
    held: every block moves and nothing is recomputed. (Loading all 95 tokens, vLLM's
    decode freed block 0 itself and token 94 attended to its null block: logprobs off by
    0.005.)"""
    p, d, _, _ = hybrid_engines
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


def test_engines_that_cannot_pair_with_a_stock_peer_refuse_it_and_compute_the_prompt(
    hybrid_engines: tuple[Engine, Engine, Engine, Engine],
) -> None:
    """The UCX pair cannot pair with an engine running vLLM's own NixlConnector: a decode on
    UCX cannot load a stock prefill's NIXL metadata, and a prefill that stops before the last
    prompt token serves stock decodes no metadata (vLLM's decode would line its lists up at
    the last token). Each load fails and the decode computes the prompt itself, never from
    the other's KV."""
    p, d, stock, _ = hybrid_engines
    x = prompt(61, 150)
    # A stock prefill's params at a kvxfer decode.
    external = d.call({"op": "external_tokens"})
    (out,) = decode(d, [x], prefill(stock, [x]))
    assert d.call({"op": "external_tokens"}) == external, "a stock prefill's KV was loaded"
    (local,) = decode(d, [x], [None])
    assert_same_output(out, local)
    failures = [line for line in d.log_text().splitlines() if "kvxfer: load of" in line]
    assert failures and "stock peers cannot be loaded" in failures[-1], failures
    # A kvxfer prefill's params at a stock decode.
    external = stock.call({"op": "external_tokens"})
    (out,) = decode(stock, [x], prefill(p, [x]), timeout=180)
    assert stock.call({"op": "external_tokens"}) == external, "a kvxfer prefill's KV was loaded"
    (local,) = decode(stock, [x], [None])
    assert_same_output(out, local)


def held(ids: list[int]) -> list[int]:
    """A stock prefill's list without the null blocks (id 0) of freed out-of-window blocks."""
    return [b for b in ids if b != 0]


def assert_groups_arrived(
    src: Engine,
    dst: Engine,
    lengths: list[int],
    params: list[dict[str, Any]],
    before: dict[str, Any],
) -> None:
    """Every block the prefill `src` lists (per group, its layers; the last partial block
    left out: the decode computes into it) is in the decode `dst`'s cache now, not before."""
    p_blocks = src.call({"op": "kv_hashes"})
    after = dst.call({"op": "kv_hashes"})
    for n, q in zip(lengths, params, strict=True):
        for layer, group in GROUP_OF_LAYER.items():
            for block in full_blocks(held(q["remote_block_ids"][group]), n):
                h = p_blocks[str(layer)][str(block)]
                assert h in after[str(layer)].values(), f"{n}: layer {layer} block {block}"
                assert h not in before[str(layer)].values(), f"{n}: layer {layer} {block} was there"


def assert_loaded_as_computed(
    src: Engine, dst: Engine, xs: list[list[int]], params: list[dict[str, Any]], loaded: int
) -> None:
    """The decode `dst` loads the prompts `xs` from the prefill `src` (`loaded` tokens in all),
    every listed block arriving, and generates what it generates computing them itself."""
    lengths = [len(x) for x in xs]
    before = dst.call({"op": "kv_hashes"})
    external = dst.call({"op": "external_tokens"})
    remote = decode(dst, xs, params, timeout=180)
    assert dst.call({"op": "external_tokens"}) - external == loaded
    assert_groups_arrived(src, dst, lengths, params, before)
    local = decode(dst, xs, [None] * len(xs))
    for r, q in zip(remote, local, strict=True):
        assert_same_output(r, q)


def test_a_kvxfer_decode_loads_every_group_from_a_stock_prefill(
    hybrid_engines: tuple[Engine, Engine, Engine, Engine],
) -> None:
    """vLLM's own NixlConnector registers each memory two layers share once (marked as
    shared by groups) and computes the whole prompt: a kvxfer decode reads its regions as
    its own layers', each group by its own block ids (a sliding-window group's null blocks
    never read), all but the last prompt token, which it computes itself."""
    _, _, stock, b = hybrid_engines
    lengths = [40, 100, 150, 257]  # none where the last window starts a block
    xs = [prompt(70 + i, n) for i, n in enumerate(lengths)]
    params = prefill(stock, xs)
    for n, q in zip(lengths, params, strict=True):
        assert q["remote_num_tokens"] == n, q
    # All but the last prompt token, which the kvxfer decode computes.
    assert_loaded_as_computed(stock, b, xs, params, sum(lengths) - len(lengths))
    # The negative control: another prompt's KV, read, changes the output.
    assert_kv_of_another_prompt_changes_the_output(stock, b, 80, 150)


def test_a_stock_decode_loads_every_group_from_a_kvxfer_prefill(
    hybrid_engines: tuple[Engine, Engine, Engine, Engine],
) -> None:
    """A kvxfer prefill computing whole prompts (`stop_short` false) serves vLLM's own
    NixlConnector its regions as vLLM registers them and its lists as vLLM hands them (a
    sliding-window group's last blocks, null ones included): the stock decode loads every
    prompt token and generates what it generates computing the prompt itself."""
    _, _, stock, b = hybrid_engines
    lengths = [40, 96, 150, 257]
    xs = [prompt(90 + i, n) for i, n in enumerate(lengths)]
    params = prefill(b, xs)
    # 96 tokens: the prefill freed block 0 (no window from token 96 on reads it); vLLM's
    # decode still pairs three sliding-window blocks, the first a null block.
    assert params[1]["remote_block_ids"][1][0] == 0, params[1]
    for n, q in zip(lengths, params, strict=True):
        full, sliding = q["remote_block_ids"]
        assert q["remote_num_tokens"] == n, q
        assert len(full) == -(-n // BLOCK), q
        # vLLM's clip: window / block + 1 blocks, the freed ones as null blocks.
        assert len(sliding) == min(-(-n // BLOCK), WINDOW // BLOCK + 1), q
    assert_loaded_as_computed(b, stock, xs, params, sum(lengths))
    assert_kv_of_another_prompt_changes_the_output(b, stock, 81, 150)


def test_a_prompt_whose_last_window_starts_in_a_freed_block_is_not_handed_off(
    hybrid_engines: tuple[Engine, Engine, Engine, Engine],
) -> None:
    """95 tokens computed whole: vLLM frees block 0, where the window of token 94 starts
    (64 tokens: 31 to 94). No decode can load that prompt as it was left (vLLM's decode,
    given a null block there, generated otherwise than computing the prompt, by 0.02 in the
    first logprob): the prefill hands off nothing and the decode computes the prompt."""
    _, _, stock, b = hybrid_engines
    x = prompt(63, 95)
    (out,) = b.call(
        {
            "op": "generate",
            "max_tokens": 1,
            "requests": [{"prompt": x, "params": {"do_remote_decode": True}}],
        }
    )
    assert out["params"] is None, out
    assert any("not handed off" in line for line in b.log_text().splitlines())


def test_a_stock_prefill_that_freed_a_block_the_window_reads_fails_the_load_by_group(
    hybrid_engines: tuple[Engine, Engine, Engine, Engine],
) -> None:
    """A 95-token prompt computed whole by vLLM's own connector: it freed block 0, which
    the window of token 94 (the one the kvxfer decode computes) starts in. The load fails
    naming the group before anything is read, and the decode computes the prompt itself."""
    _, _, stock, b = hybrid_engines
    x = prompt(62, 95)
    (params,) = prefill(stock, [x])
    assert params["remote_block_ids"][1][0] == 0, params
    external = b.call({"op": "external_tokens"})
    (out,) = decode(b, [x], [params])
    assert b.call({"op": "external_tokens"}) == external
    (local,) = decode(b, [x], [None])
    assert_same_output(out, local)
    failures = [line for line in b.log_text().splitlines() if "kvxfer: load of" in line]
    assert failures and "KV cache group 1" in failures[-1], failures
