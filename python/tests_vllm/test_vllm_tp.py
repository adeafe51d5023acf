"""Heterogeneous tensor parallelism on a real vLLM: a TP 1 prefill and a TP 2 decode. Each
decode rank pulls its own KV head of every block from the one prefill rank."""

from flows import BLOCK, assert_same_output, block_ids, decode, kvxfer_metrics, prefill, prompt
from harness import Engine

HeadHashes = dict[str, dict[str, list[str]]]  # layer -> block -> one hash per KV head


def blocks_of(rank: HeadHashes, layer: str) -> set[tuple[str, ...]]:
    return {tuple(heads) for heads in rank[layer].values()}


def test_each_decode_rank_pulls_its_own_heads_and_the_output_equals_a_local_run(
    tp_engines: tuple[Engine, Engine],
) -> None:
    p, d = tp_engines
    x = prompt(41, 100)  # three full blocks and a partial one
    before: list[HeadHashes] = d.call({"op": "kv_head_hashes"})
    assert len(before) == 2
    metrics = kvxfer_metrics(d)
    external = d.call({"op": "external_tokens"})
    (params,) = prefill(p, [x])
    (p_heads,) = p.call({"op": "kv_head_hashes"})
    (remote,) = decode(d, [x], [params], timeout=500)
    # The decode did not compute the prompt: every token came through the connector.
    assert d.call({"op": "external_tokens"}) - external == len(x)
    after: list[HeadHashes] = d.call({"op": "kv_head_hashes"})
    full = block_ids(params)[: len(x) // BLOCK]
    assert len(full) == 3 and len(p_heads) == 2, (full, list(p_heads))
    for layer, blocks in p_heads.items():
        heads = len(next(iter(blocks.values())))
        per_rank = heads // len(after)
        for rank, (was, now) in enumerate(zip(before, after, strict=True)):
            for block in full:
                mine = tuple(blocks[str(block)][rank * per_rank : (rank + 1) * per_rank])
                assert mine in blocks_of(now, layer), f"rank {rank} layer {layer} block {block}"
                assert mine not in blocks_of(was, layer), f"rank {rank} had block {block} before"
    # One handshake per decode rank with the one prefill rank, no failure.
    now = kvxfer_metrics(d)
    assert now["vllm:kvxfer_handshakes"] - metrics.get("vllm:kvxfer_handshakes", 0) == 2
    assert now.get("vllm:kvxfer_failed_transfers", 0) == 0
    (local,) = decode(d, [x], [None], timeout=500)
    assert_same_output(remote, local)
