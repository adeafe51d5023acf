"""The push flow across tensor parallelism on a real vLLM, both ways, with
KvxferPushConnector on a TP 2 engine and a TP 1 engine (each serves as prefill and as decode):
a TP 2 prefill's ranks each stream their own KV head of every layer into the TP 1 decode's
blocks, which hold both; a TP 1 prefill streams each head into the TP 2 decode rank that
holds it."""

from collections.abc import Iterator

import pytest
from conftest import _usable_or_skip, running
from flows import BLOCK, assert_same_output, decode, prompt
from harness import Engine, free_port
from push_flows import PUSH, handoff

HeadHashes = dict[str, dict[str, list[str]]]  # layer -> block -> one hash per KV head


@pytest.fixture(scope="module")
def push_tp_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Engine, int, int]]:
    """The TP 2 engine, the TP 1 engine, and the ports of their push registries (what a
    decode names as `remote_port`). vLLM's CPU TP workers can sleep up to 5 s at a time (see
    `tp_engines`): long bounds."""
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-push-tp")
    tp2_port, tp1_port = free_port(), free_port()
    extra = {"transport": "ucx", "bootstrap_timeout": 120.0}
    with running(
        [
            Engine(
                "push-tp2",
                "0|1",
                {**extra, "side_channel_port": tp2_port},
                logdir,
                connector=PUSH,
                opts={"tp": 2},
            ),
            Engine(
                "push-tp1",
                "1",
                {**extra, "side_channel_port": tp1_port},
                logdir,
                connector=PUSH,
            ),
        ],
        logdir,
    ) as (tp2, tp1):
        yield tp2, tp1, tp2_port, tp1_port


def test_each_prefill_rank_writes_its_heads_and_the_output_equals_a_local_run(
    push_tp_engines: tuple[Engine, Engine, int, int],
) -> None:
    p, d, port, _ = push_tp_engines
    x = prompt(71, 100)  # three full blocks and a partial one
    (before,) = d.call({"op": "kv_head_hashes"})
    (p_out,), (remote,) = handoff(p, d, port, [x], [x], asked_first=True, timeout=400)
    written = p_out["params"]["remote_block_ids"][: len(x) // BLOCK]
    p_heads: list[HeadHashes] = p.call({"op": "kv_head_hashes"})
    (after,) = d.call({"op": "kv_head_hashes"})
    assert len(p_heads) == 2 and len(written) == 3, (len(p_heads), written)
    # Each decode block now holds, head by head, what the prefill ranks held: rank r's head
    # as the decode's head r.
    for layer, blocks in after.items():
        now = {tuple(h) for h in blocks.values()}
        was = {tuple(h) for h in before.get(layer, {}).values()}
        for block in written:
            heads = tuple(rank[layer][str(block)][0] for rank in p_heads)
            assert heads in now, f"layer {layer} block {block}"
            assert heads not in was, f"layer {layer} block {block} was there"
    (local,) = decode(d, [x], [None], timeout=400)
    assert_same_output(remote, local)


def test_a_tp1_prefill_writes_each_head_into_the_tp2_decode_rank_holding_it(
    push_tp_engines: tuple[Engine, Engine, int, int],
) -> None:
    d, p, _, port = push_tp_engines
    x = prompt(72, 100)  # three full blocks and a partial one
    before: list[HeadHashes] = d.call({"op": "kv_head_hashes"})
    (p_out,), (remote,) = handoff(p, d, port, [x], [x], asked_first=True, timeout=400)
    written = p_out["params"]["remote_block_ids"][: len(x) // BLOCK]
    (p_heads,) = p.call({"op": "kv_head_hashes"})
    after: list[HeadHashes] = d.call({"op": "kv_head_hashes"})
    assert len(after) == 2 and len(written) == 3, (len(after), written)

    def by_block(ranks: list[HeadHashes], layer: str) -> set[tuple[str, ...]]:
        """Each decode block's heads across the ranks (rank r holds head r), as tuples."""
        blocks = set(ranks[0].get(layer, {})) & set(ranks[1].get(layer, {}))
        return {tuple(r[layer][b][0] for r in ranks) for b in blocks}

    # The prefill's block, head by head, is now a decode block whose rank r holds head r.
    for layer, blocks in p_heads.items():
        now, was = by_block(after, layer), by_block(before, layer)
        for block in written:
            heads = tuple(blocks[str(block)])
            assert len(heads) == 2, heads
            assert heads in now, f"layer {layer} block {block}"
            assert heads not in was, f"layer {layer} block {block} was there"
    (local,) = decode(d, [x], [None], timeout=400)
    assert_same_output(remote, local)
