"""A Nemotron-H (Mamba2 layers beside attention layers, as Nemotron-H, Jamba and Granite 4
interleave them) in real vLLM engines: vLLM's hybrid KV cache manager gives the Mamba layers
a KV cache group of state pages (one running state per request, padded to the attention
block) and the attention layers a group of KV blocks, the two laid over the same memory.
KvxferConnector moves both: the prefill computes every prompt token but the last, the
decode loads each layer's state page whole and the attention blocks as KV, computes the last
token itself and generates exactly what it generates computing the whole prompt."""

from flows import (
    BLOCK,
    assert_kv_of_another_prompt_changes_the_output,
    assert_same_output,
    decode,
    kvxfer_metrics,
    prefill,
    prompt,
)
from harness import Engine

# make_model.py's `nemotron-h`: Mamba, attention, Mamba, attention.
STATE_LAYERS, ATTENTION_LAYERS = (0, 2), (1, 3)
# vLLM's group order for it: the Mamba group, then the attention group.
STATE_GROUP, ATTENTION_GROUP = 0, 1
# An attention block (2 KV heads x 32 tokens x (K + V of 64) x fp32); vLLM pads each
# 19,840-byte state page to it.
PAGE = 2 * BLOCK * 2 * 64 * 4
LENGTHS = [12, 100, 161, 300]  # 300: past the 256-token scan chunk


def test_state_and_kv_arrive_and_the_decode_equals_computing_the_prompt(
    nemotron_engines: tuple[Engine, Engine],
) -> None:
    p, d = nemotron_engines
    xs = [prompt(90 + i, n) for i, n in enumerate(LENGTHS)]
    params = prefill(p, xs)
    for n, q in zip(LENGTHS, params, strict=True):
        # The prefill stopped one token short: one state block, the attention blocks of n - 1.
        assert q["remote_num_tokens"] == n - 1, q
        assert len(q["remote_block_ids"][STATE_GROUP]) == 1, q
        assert len(q["remote_block_ids"][ATTENTION_GROUP]) == -(-(n - 1) // BLOCK), q
    p_blocks = p.call({"op": "kv_hashes"})
    before = d.call({"op": "kv_hashes"})
    external = d.call({"op": "external_tokens"})
    moved = kvxfer_metrics(d).get("vllm:kvxfer_bytes", 0)
    ours = decode(d, xs, params)
    assert d.call({"op": "external_tokens"}) - external == sum(n - 1 for n in LENGTHS)
    # Per request: each Mamba layer's page, each attention layer's blocks; nothing else.
    blocks = sum(-(-(n - 1) // BLOCK) for n in LENGTHS)
    expected = (len(xs) * len(STATE_LAYERS) + blocks * len(ATTENTION_LAYERS)) * PAGE
    assert kvxfer_metrics(d)["vllm:kvxfer_bytes"] - moved == expected
    # The attention blocks the prefill filled are, byte for byte, in the decode's own cache
    # tensors (the last, partial one also takes the token the decode computes; the state
    # pages the decode updates in place as it computes).
    after = d.call({"op": "kv_hashes"})
    for n, q in zip(LENGTHS, params, strict=True):
        ids = q["remote_block_ids"][ATTENTION_GROUP]
        full = ids[:-1] if (n - 1) % BLOCK else ids
        for layer in ATTENTION_LAYERS:
            for block in full:
                h = p_blocks[str(layer)][str(block)]
                assert h in after[str(layer)].values(), f"layer {layer}: block {block} missing"
                assert h not in before[str(layer)].values(), f"layer {layer}: {block} was there"
    for x, out in zip(xs, ours, strict=True):
        (local,) = decode(d, [x], [None])
        assert_same_output(out, local)


def test_state_and_kv_of_another_prompt_change_the_output(
    nemotron_engines: tuple[Engine, Engine],
) -> None:
    p, d = nemotron_engines
    assert_kv_of_another_prompt_changes_the_output(p, d, 95, 150)


def test_a_state_past_the_tokens_loaded_is_refused(
    nemotron_engines: tuple[Engine, Engine],
) -> None:
    """A prefill that says it computed the whole prompt (vLLM's own connector does, on a
    model without state): its state holds the last token too, which the decode would count
    twice. The load fails, naming both counts, and nothing is read."""
    p, d = nemotron_engines
    x = prompt(97, 120)
    (params,) = prefill(p, [x])
    moved = kvxfer_metrics(d).get("vllm:kvxfer_bytes", 0)
    (out,) = decode(d, [x], [{**params, "remote_num_tokens": len(x)}])
    assert out["finish"] == "error" and out["tokens"] == [], out
    assert kvxfer_metrics(d).get("vllm:kvxfer_bytes", 0) == moved
    (fresh,) = decode(d, [x], prefill(p, [x]))
    (local,) = decode(d, [x], [None])
    assert_same_output(fresh, local)
