"""bf16 caches, a decode-side prefix-cache hit, and a prefill whose cache does not fit the
decode's, on real vLLM engines over UCX."""

import pytest
from flows import (
    BLOCK,
    assert_blocks_arrived,
    assert_same_output,
    block_ids,
    decode,
    kvxfer_metrics,
    prefill,
    prompt,
)
from harness import Engine


def local_run(d: Engine, x: list[int]) -> dict:
    # The decode caches prefixes: forget them, so that this run computes every token.
    assert d.call({"op": "reset_prefix_cache"})
    (local,) = decode(d, [x], [None])
    return local


def test_bf16_blocks_arrive_byte_identical_and_output_equals_a_local_run(
    bf16_engines: tuple[Engine, Engine],
) -> None:
    p, d = bf16_engines
    x = prompt(21, 100)
    (params,) = prefill(p, [x])
    p_blocks = p.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    (remote,) = decode(d, [x], [params])
    assert d.call({"op": "external_tokens"}) - external == len(x)
    after = d.call({"op": "kv_hashes"})
    assert_blocks_arrived(p_blocks, None, after, block_ids(params)[: len(x) // BLOCK])
    assert_same_output(remote, local_run(d, x))


def test_a_decode_prefix_cache_hit_moves_only_the_missing_blocks(
    bf16_engines: tuple[Engine, Engine],
) -> None:
    p, d = bf16_engines
    assert d.call({"op": "reset_prefix_cache"})
    head = prompt(22, 3 * BLOCK)
    x = head + prompt(23, 2 * BLOCK)
    decode(d, [head], [None])  # the decode computes x's first 3 blocks itself and caches them
    (params,) = prefill(p, [x])
    assert len(block_ids(params)) == 5
    external = d.call({"op": "external_tokens"})
    metrics = kvxfer_metrics(d)
    (remote,) = decode(d, [x], [params])
    assert d.call({"op": "external_tokens"}) - external == 2 * BLOCK
    # Only the 2 missing blocks moved: 2 blocks × 2 layers × 16 KiB (bf16).
    moved = kvxfer_metrics(d)["vllm:kvxfer_bytes"] - metrics.get("vllm:kvxfer_bytes", 0)
    assert moved == 2 * 2 * 16 * 1024
    assert_same_output(remote, local_run(d, x))


@pytest.mark.parametrize("engines", ["ucx"], indirect=True)
def test_an_incompatible_prefill_fails_the_request_and_the_log_names_the_mismatch(
    engines: tuple[Engine, Engine], bf16_engines: tuple[Engine, Engine]
) -> None:
    fp32_prefill, _ = engines
    _, d = bf16_engines
    x = prompt(24, 64)
    (params,) = prefill(fp32_prefill, [x])
    (out,) = decode(d, [x], [params])
    assert out["finish"] == "error", out
    failures = [line for line in d.log_text().splitlines() if "kvxfer: load of" in line]
    assert failures and "dtype: local bf16, remote f32" in failures[-1], failures
    # The decode keeps serving.
    y = prompt(25, 64)
    (remote,) = decode(d, [y], prefill(bf16_engines[0], [y]))
    assert_same_output(remote, local_run(d, y))
