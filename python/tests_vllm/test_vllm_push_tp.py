"""The push flow across tensor parallelism on a real vLLM: a TP 2 prefill writes into a TP 1
decode with KvxferPushConnector, each prefill rank streaming its own KV head of every layer
into the decode's blocks, which hold both."""

from collections.abc import Iterator

import pytest
from conftest import _usable_or_skip, running
from flows import BLOCK, assert_same_output, decode, prompt
from harness import Engine, free_port
from test_vllm_push import PUSH, handoff

HeadHashes = dict[str, dict[str, list[str]]]  # layer -> block -> one hash per KV head


@pytest.fixture(scope="module")
def push_tp_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Engine, int]]:
    """vLLM's CPU TP workers can sleep up to 5 s at a time (see `tp_engines`): long bounds."""
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-push-tp")
    port = free_port()
    extra = {"transport": "ucx", "bootstrap_timeout": 120.0}
    with running(
        [
            Engine(
                "prefill-tp2",
                "0|1",
                {**extra, "side_channel_port": port},
                logdir,
                connector=PUSH,
                opts={"tp": 2},
            ),
            Engine(
                "decode-tp1",
                "1",
                {**extra, "side_channel_port": free_port()},
                logdir,
                connector=PUSH,
            ),
        ],
        logdir,
    ) as (p, d):
        yield p, d, port


def test_each_prefill_rank_writes_its_heads_and_the_output_equals_a_local_run(
    push_tp_engines: tuple[Engine, Engine, int],
) -> None:
    p, d, port = push_tp_engines
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
