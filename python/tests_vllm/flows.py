"""The hand-off as the real-engine tests drive it: the prefill computes prompts for a remote
decode, the decode generates from the parameters the prefill returned."""

import random
from typing import Any

from harness import Engine

BLOCK = 32
DECODE_TOKENS = 8


def block_ids(params: dict[str, Any]) -> list[int]:
    """The prefill's block ids in `params`: vLLM 0.32 writes one list per KV cache group."""
    ids = params["remote_block_ids"]
    if ids and isinstance(ids[0], list):
        assert all(not g for g in ids[1:]), ids
        return list(ids[0])
    return list(ids)


def prompt(seed: int, length: int) -> list[int]:
    return random.Random(seed).choices(range(3, 1000), k=length)


def prefill(p: Engine, prompts: list[list[int]], timeout: float = 120) -> list[dict[str, Any]]:
    out = p.call(
        {
            "op": "generate",
            "max_tokens": 1,
            "requests": [{"prompt": x, "params": {"do_remote_decode": True}} for x in prompts],
        },
        timeout=timeout,
    )
    for o in out:
        assert o["params"] and o["params"]["do_remote_prefill"], o
    return [o["params"] for o in out]


def decode_cmd(prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    reqs = [{"prompt": x, "params": q} for x, q in zip(prompts, params, strict=True)]
    return {"op": "generate", "max_tokens": DECODE_TOKENS, "requests": reqs}


def decode(
    d: Engine, prompts: list[list[int]], params: list[Any], timeout: float = 120
) -> list[dict[str, Any]]:
    return d.call(decode_cmd(prompts, params), timeout=timeout)


def assert_same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["finish"] == b["finish"] == "length", (a["finish"], b["finish"])
    assert a["tokens"] == b["tokens"]
    diff = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
    assert diff < 1e-4, f"logprobs differ by {diff}"


def assert_blocks_arrived(
    p_blocks: dict[str, dict[str, str]],
    before: dict[str, dict[str, str]] | None,
    after: dict[str, dict[str, str]],
    block_ids: list[int],
) -> None:
    """Every listed prefill block is, byte for byte, in the decode's cache `after`, per layer,
    and was not `before`."""
    for layer, hashes in p_blocks.items():
        for block in block_ids:
            h = hashes[str(block)]
            assert h in after[layer].values(), f"layer {layer}: block {block} did not arrive"
            if before is not None:
                assert h not in before[layer].values(), f"layer {layer}: block {block} was there"


def kvxfer_metrics(e: Engine) -> dict[str, float]:
    return e.call({"op": "metrics", "prefix": "vllm:kvxfer_"})


def unchecked(params: dict[str, Any]) -> dict[str, Any]:
    """`params` without `remote_num_tokens`: the decode then cannot name the tokens the
    prefill computed, so its load is not checked against the prompt (kvxfer refuses another
    prompt's KV otherwise). How a negative control loads another prompt's KV on purpose."""
    return {k: v for k, v in params.items() if k != "remote_num_tokens"}


def assert_kv_of_another_prompt_changes_the_output(
    p: Engine, d: Engine, seed: int, length: int
) -> None:
    """The negative control: a decode given the KV of another prompt (seed + 1) generates
    otherwise than computing its own prompt (seed), so the KV it pulls is what it uses."""
    x, y = prompt(seed, length), prompt(seed + 1, length)
    (params_y,) = prefill(p, [y])
    (wrong,) = decode(d, [x], [unchecked(params_y)])
    (local,) = decode(d, [x], [None])
    assert wrong["finish"] == "length", wrong
    assert wrong["logprobs"] != local["logprobs"], "the decode ignored the KV it pulled"
