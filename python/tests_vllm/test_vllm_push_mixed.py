"""KvxferPushConnector beside vLLM's own NixlPushConnector: their push protocols differ
(vLLM's: a NIXL notification registering the decode's blocks; kvxfer's: rooms through the
prefill's push registry), so neither pairs with the other. Each direction fails the
decode's request within seconds, kvxfer's log says why, and both engines go on serving."""

import time
from collections.abc import Iterator

import pytest
from conftest import _usable_or_skip, running
from flows import decode, prompt
from harness import Engine, free_port
from push_flows import PUSH, handoff

STOCK_PUSH = ("NixlPushConnector", "vllm.distributed.kv_transfer.kv_connector.v1.nixl")


@pytest.fixture(scope="module")
def mixed_push(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Engine, int, int]]:
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-push-mixed")
    stock_port, our_port = free_port(), free_port()
    with running(
        [
            Engine(
                "stock-push",
                "1",
                {},
                logdir,
                connector=STOCK_PUSH,
                env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(stock_port)},
            ),
            Engine(
                "kvxfer-push",
                "0",
                {"transport": "ucx", "side_channel_port": our_port, "bootstrap_timeout": 5.0},
                logdir,
                connector=PUSH,
            ),
        ],
        logdir,
    ) as (stock, ours):
        yield stock, ours, stock_port, our_port


def test_a_stock_prefill_fails_a_kvxfer_decodes_request_saying_why(
    mixed_push: tuple[Engine, Engine, int, int],
) -> None:
    stock, ours, stock_port, _ = mixed_push
    x = prompt(81, 64)
    start = time.monotonic()
    _, (out,) = handoff(stock, ours, stock_port, [x], [x], timeout=60)
    assert out["finish"] != "length", out
    assert time.monotonic() - start < 30
    assert "must run KvxferPushConnector" in ours.log_text()
    (local,) = decode(ours, [x], [None])
    assert local["finish"] == "length"


def test_a_kvxfer_prefill_fails_a_stock_decodes_request(
    mixed_push: tuple[Engine, Engine, int, int],
) -> None:
    stock, ours, _, our_port = mixed_push
    x = prompt(82, 64)
    start = time.monotonic()
    _, (out,) = handoff(ours, stock, our_port, [x], [x], timeout=60)
    assert out["finish"] != "length", out
    assert time.monotonic() - start < 30
    (local,) = decode(stock, [x], [None])
    assert local["finish"] == "length"
