"""fp8 KV caches in real vLLM engines (UCX): an e4m3 cache moves byte for byte and the decode
generates what it generates computing the prompt itself; an e5m2 prefill, whose uint8 tensors
look like an e4m3 one's, is refused by its format."""

from flows import (
    BLOCK,
    assert_blocks_arrived,
    assert_kv_of_another_prompt_changes_the_output,
    assert_same_output,
    block_ids,
    decode,
    kvxfer_metrics,
    prefill,
    prompt,
)
from harness import Engine


def test_fp8_blocks_arrive_byte_identical_and_output_equals_a_local_run(
    fp8_engines: tuple[Engine, ...],
) -> None:
    p, d, _ = fp8_engines
    lengths = [33, 100, 257]
    xs = [prompt(70 + i, n) for i, n in enumerate(lengths)]
    before = d.call({"op": "kv_hashes"})
    params = prefill(p, xs)
    p_blocks = p.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    metrics = kvxfer_metrics(d)
    remote = decode(d, xs, params)
    assert d.call({"op": "external_tokens"}) - external == sum(lengths)
    after = d.call({"op": "kv_hashes"})
    for x, q in zip(xs, params, strict=True):
        assert_blocks_arrived(p_blocks, before, after, block_ids(q)[: len(x) // BLOCK])
    # One byte an element: a block of 32 tokens × 2 heads × (K + V) × 64 is 8 KiB a layer.
    blocks = sum(-(-n // BLOCK) for n in lengths)
    moved = kvxfer_metrics(d)["vllm:kvxfer_bytes"] - metrics.get("vllm:kvxfer_bytes", 0)
    assert moved == blocks * 2 * 8 * 1024
    local = decode(d, xs, [None] * len(xs))
    for r, q in zip(remote, local, strict=True):
        assert_same_output(r, q)


def test_fp8_kv_of_another_prompt_changes_the_output(fp8_engines: tuple[Engine, ...]) -> None:
    p, d, _ = fp8_engines
    assert_kv_of_another_prompt_changes_the_output(p, d, 80, 96)


def test_an_e5m2_prefill_is_refused_by_an_e4m3_decode_naming_both(
    fp8_engines: tuple[Engine, ...],
) -> None:
    p, d, e5m2 = fp8_engines
    x = prompt(82, 64)
    (params,) = prefill(e5m2, [x])
    (out,) = decode(d, [x], [params])
    assert out["finish"] == "error", out
    failures = [line for line in d.log_text().splitlines() if "kvxfer: load of" in line]
    assert failures and "dtype: local fp8_e4m3, remote fp8_e5m2" in failures[-1], failures
    (remote,) = decode(d, [x], prefill(p, [x]))  # the decode keeps serving
    (local,) = decode(d, [x], [None])
    assert_same_output(remote, local)
