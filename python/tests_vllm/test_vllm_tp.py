"""Heterogeneous tensor parallelism on real vLLM engines: a TP 1 prefill holds both KV heads
of the test model in one cache; each rank of a TP 2 decode holds one and READs only its own
head's bytes from the prefill."""

from flows import BLOCK, assert_same_output, decode, kvxfer_metrics, prefill, prompt
from harness import Engine


def test_each_decode_rank_loads_its_heads_from_a_tp1_prefill(
    tp_engines: tuple[Engine, Engine],
) -> None:
    p, d = tp_engines
    xs = [prompt(41, 100), prompt(42, 2 * BLOCK)]
    params = prefill(p, xs)
    (p_heads,) = p.call({"op": "kv_head_hashes"})  # TP 1: one rank, both heads per block
    before = d.call({"op": "kv_head_hashes"})
    assert len(before) == 2
    metrics = kvxfer_metrics(d)
    remote = decode(d, xs, params)
    # One handshake per decode rank, each with the prefill's only rank.
    handshakes = kvxfer_metrics(d)["vllm:kvxfer_handshakes"]
    assert handshakes - metrics.get("vllm:kvxfer_handshakes", 0) == 2
    after = d.call({"op": "kv_head_hashes"})
    for x, q in zip(xs, params, strict=True):
        for layer, blocks in p_heads.items():
            # The decode computes the prompt's last token itself and writes its KV into the
            # last block; with TP 2 that differs from the prefill's in the last bits from
            # layer 1 on (the hidden state went through an all-reduce): leave that block out.
            for block in q["remote_block_ids"][: (len(x) - 1) // BLOCK]:
                heads = blocks[str(block)]
                assert len(heads) == 2, f"layer {layer}: the prefill holds {len(heads)} heads"
                for rank, head in enumerate(heads):
                    # Decode rank `rank` holds exactly one head: the prefill's head `rank`.
                    got = [h for hs in after[rank][layer].values() for h in hs]
                    was = [h for hs in before[rank][layer].values() for h in hs]
                    assert head in got, f"layer {layer} block {block}: head {rank} missing"
                    assert head not in was, f"layer {layer} block {block}: head {rank} was there"
    local = decode(d, xs, [None, None])
    for r, loc in zip(remote, local, strict=True):
        assert_same_output(r, loc)
