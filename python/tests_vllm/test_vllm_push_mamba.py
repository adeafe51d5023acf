"""A Mamba2 model (per-request recurrent state instead of a KV cache) in vLLM's push flow
with KvxferPushConnector: the prefill computes every prompt token but the last and writes
each layer's state page (convolution state, then SSM state) whole into the decode's state
block; the decode computes the last prompt token on that state and must generate what it
generates computing the whole prompt. One pair of engines (UCX)."""

import time
from collections.abc import Iterator

import pytest
from flows import assert_same_output, decode, prompt
from harness import MAMBA_MODEL, Engine
from push_flows import (
    assert_pushed_kv_of_another_prompt_changes_the_output,
    handoff,
    push_metrics,
    push_pair,
)

LAYERS = 2
PAGE = 3 * 288 * 4 + 8 * 32 * 16 * 4  # conv (3 taps x 288 channels) + SSM (8 x 32 x 16), fp32


@pytest.fixture(scope="module")
def push_mamba_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Engine, int]]:
    yield from push_pair(tmp_path_factory, "push-mamba", MAMBA_MODEL)


def test_the_state_pages_are_written_and_outputs_equal_a_local_run(
    push_mamba_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_mamba_engines
    lengths = [12, 100, 161, 300]  # 300: past the 256-token scan chunk
    xs = [prompt(210 + i, n) for i, n in enumerate(lengths)]
    external = d.call({"op": "external_tokens"})
    written = push_metrics(p).get("vllm:kvxfer_push_bytes", 0)
    p_out, remote = handoff(p, d, port, xs, xs, timeout=240)
    for n, out in zip(lengths, p_out, strict=True):
        assert out["params"]["remote_num_tokens"] == n - 1, out["params"]
    # All but the last prompt token came from the prefill: the decode computed that one.
    assert d.call({"op": "external_tokens"}) - external == sum(lengths) - len(lengths)
    # One page per layer and request, nothing else.
    expected = len(xs) * LAYERS * PAGE
    deadline = time.monotonic() + 30
    while push_metrics(p).get("vllm:kvxfer_push_bytes", 0) - written < expected:
        assert time.monotonic() < deadline, push_metrics(p)
        time.sleep(0.1)
    assert push_metrics(p)["vllm:kvxfer_push_bytes"] - written == expected
    local = decode(d, xs, [None] * len(xs))
    for r, q in zip(remote, local, strict=True):
        assert_same_output(r, q)


def test_the_state_of_another_prompt_changes_the_output(
    push_mamba_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_mamba_engines
    assert_pushed_kv_of_another_prompt_changes_the_output(p, d, port, 220)
