"""A Mamba2 model (per-request recurrent state instead of a KV cache) in real vLLM engines.
The prefill computes every prompt token but the last and stops there; KvxferConnector moves
each layer's state page (convolution state, then SSM state) whole into the decode's state
block; the decode computes the last prompt token on that state and generates exactly what it
generates computing the whole prompt itself. A decode given another prompt's state generates
otherwise, so the state it loads is the state it uses. The pair's prefill holds unread state
for a few seconds only: a reference past that lease fails its load (#38)."""

import time

from conftest import MAMBA_LEASE
from flows import assert_same_output, decode, kvxfer_metrics, prefill, prompt, unchecked
from harness import Engine

LAYERS = 2
PAGE = 3 * 288 * 4 + 8 * 32 * 16 * 4  # conv (3 taps x 288 channels) + SSM (8 x 32 x 16), fp32
LENGTHS = [12, 100, 161, 300]  # 300: past the 256-token scan chunk


def test_decode_from_the_loaded_state_equals_computing_the_prompt(
    mamba_engines: tuple[Engine, Engine],
) -> None:
    p, d = mamba_engines
    xs = [prompt(70 + i, n) for i, n in enumerate(LENGTHS)]
    external = d.call({"op": "external_tokens"})
    moved = kvxfer_metrics(d).get("vllm:kvxfer_bytes", 0)
    params = prefill(p, xs)
    # The prefill stopped one token short: the decode computes the last token on the state.
    assert [q["remote_num_tokens"] for q in params] == [n - 1 for n in LENGTHS]
    ours = decode(d, xs, params)
    assert d.call({"op": "external_tokens"}) - external == sum(n - 1 for n in LENGTHS)
    # One page per layer and request, nothing else.
    moved = kvxfer_metrics(d)["vllm:kvxfer_bytes"] - moved
    assert moved == len(xs) * LAYERS * PAGE
    for x, out in zip(xs, ours, strict=True):
        (local,) = decode(d, [x], [None])
        assert_same_output(out, local)


def test_the_state_of_another_prompt_changes_the_output(
    mamba_engines: tuple[Engine, Engine],
) -> None:
    p, d = mamba_engines
    x, y = prompt(75, 80), prompt(76, 80)
    (params_y,) = prefill(p, [y])
    (wrong,) = decode(d, [x], [unchecked(params_y)])
    (local,) = decode(d, [x], [None])
    assert wrong["finish"] == "length", wrong
    assert wrong["logprobs"] != local["logprobs"], "the decode ignored the state it loaded"


def test_a_one_token_prompt_is_computed_by_the_decode(
    mamba_engines: tuple[Engine, Engine],
) -> None:
    """No state before the last token to move: the decode loads nothing and computes the
    token itself (loading the prefill's state after it would count that token twice)."""
    p, d = mamba_engines
    x = prompt(77, 1)
    external = d.call({"op": "external_tokens"})
    (params,) = prefill(p, [x])
    (out,) = decode(d, [x], [params])
    assert d.call({"op": "external_tokens"}) == external
    (local,) = decode(d, [x], [None])
    assert_same_output(out, local)


def test_a_reference_past_its_lease_fails_its_load(mamba_engines: tuple[Engine, Engine]) -> None:
    """The prefill's lease ran out and other requests ran there since: the decode's load of
    the old reference fails (the stamp says released), is counted, and the decode keeps
    serving. vLLM's own connector would read whatever the freed block holds by then."""
    p, d = mamba_engines
    x = prompt(78, 120)
    (old,) = prefill(p, [x])
    time.sleep(MAMBA_LEASE + 1)
    # Steps on the prefill expire the lease and free the state block for others.
    prefill(p, [prompt(79 + i, 120) for i in range(4)])
    stale = kvxfer_metrics(d).get("vllm:kvxfer_stale_references", 0)
    (late,) = decode(d, [x], [old])
    assert late["finish"] == "error" and late["tokens"] == [], late
    assert kvxfer_metrics(d)["vllm:kvxfer_stale_references"] == stale + 1
    (fresh,) = decode(d, [x], prefill(p, [x]))
    (local,) = decode(d, [x], [None])
    assert_same_output(fresh, local)
