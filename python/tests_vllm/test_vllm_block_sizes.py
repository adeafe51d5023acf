"""Engines whose blocks hold different numbers of tokens (32 and 64), in real vLLM engines
over UCX, each the other's prefill. vLLM's CPU cache is not addressable by token (its attention
kernel lays out each head's block itself), so kvxfer moves it in whole blocks only: a load
across block sizes is refused naming both sizes and why, and both engines keep serving.
(Token-range plans for caches that are addressable by token are tested in kvxfer-layout and
over every transport in kvxfer-tests.)"""

import pytest
from flows import assert_same_output, decode, prefill, prompt
from harness import Engine

DIRECTIONS = {"small-to-large": (0, 1), "large-to-small": (1, 0)}


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_a_load_across_block_sizes_is_refused_naming_both_and_serving_goes_on(
    block_size_engines: tuple[Engine, Engine], direction: str
) -> None:
    p, d = (block_size_engines[i] for i in DIRECTIONS[direction])
    sizes = {id(block_size_engines[0]): 32, id(block_size_engines[1]): 64}
    x = prompt(90 + len(direction), 100)
    (params,) = prefill(p, [x])
    (out,) = decode(d, [x], [params])
    assert out["finish"] == "error", out
    failures = [line for line in d.log_text().splitlines() if "kvxfer: load of" in line]
    want = (
        f"tokens per block: local {sizes[id(d)]} (a packed K/V cache (vLLM's CPU cache) is "
        f"not addressable by token), remote {sizes[id(p)]}"
    )
    assert failures and want in failures[-1], failures
    # Both engines keep serving, and compute the prompt alike.
    (here,) = decode(d, [x], [None])
    (there,) = decode(p, [x], [None])
    assert_same_output(here, there)
