"""What the push-flow tests share: the connector, what a router gives each engine, one
hand-off through a pair, its metrics, and a pair of engines of one model."""

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import _usable_or_skip, running
from flows import DECODE_TOKENS, decode, prompt
from harness import Engine, free_port

PUSH = ("KvxferPushConnector", "kvxfer.vllm")
_ids = itertools.count()


def request_id() -> str:
    """A request id no other push test uses (the room both engines name after it)."""
    return f"push-{next(_ids)}"


def push_params(port: int, rid: str) -> dict[str, Any]:
    """What a router gives the decode in vLLM's push flow."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "kvxfer-test-prefill",
        "remote_request_id": rid,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
    }


def handoff(
    p: Engine,
    d: Engine,
    port: int,
    p_prompts: list[list[int]],
    d_prompts: list[list[int]],
    asked_first: bool = False,
    timeout: float = 120,
    max_tokens: int = DECODE_TOKENS,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Posts `d_prompts` to the decode first, then `p_prompts` to the prefill under the same
    ids (as a router does); returns the prefill's and the decode's outputs (`max_tokens`
    each). `asked_first`: the prefill gets its requests only once it holds every decode's
    room."""
    ids = [request_id() for _ in d_prompts]
    d.send(
        {
            "op": "generate",
            "max_tokens": max_tokens,
            "requests": [
                {"id": i, "prompt": x, "params": push_params(port, i)}
                for i, x in zip(ids, d_prompts, strict=True)
            ],
        }
    )
    deadline = time.monotonic() + timeout
    while asked_first and not all(p.call({"op": "push_room_ready", "id": i}) for i in ids):
        assert time.monotonic() < deadline, "the decode's rooms never reached the prefill"
        time.sleep(0.01)
    p_out = p.call(
        {
            "op": "generate",
            "max_tokens": 1,
            "requests": [
                {"id": i, "prompt": x, "params": {"do_remote_decode": True}}
                for i, x in zip(ids, p_prompts, strict=True)
            ],
        },
        timeout=timeout,
    )
    return p_out, d.wait(timeout)


def push_metrics(e: Engine) -> dict[str, float]:
    return e.call({"op": "metrics", "prefix": "vllm:kvxfer_push_"})


def push_pair(
    tmp_path_factory: pytest.TempPathFactory, name: str, model: Path | None = None
) -> Iterator[tuple[Engine, Engine, int]]:
    """A prefill and a decode running KvxferPushConnector over UCX (of `model`, or the test
    Llama), for a module fixture to yield from: (prefill, decode, the prefill's registry
    port). Either side gives up on the other after 10 s, the decode on WRITEs after 60 s."""
    _usable_or_skip("ucx", *([model] if model is not None else []))
    logdir = tmp_path_factory.mktemp(f"vllm-{name}")
    port = free_port()
    extra = {"transport": "ucx", "bootstrap_timeout": 10.0, "waiting_timeout": 60.0}
    of = {"model": model} if model is not None else {}
    with running(
        [
            Engine(
                f"prefill-{name}",
                "0",
                {**extra, "side_channel_port": port},
                logdir,
                connector=PUSH,
                **of,
            ),
            Engine(
                f"decode-{name}",
                "1",
                {**extra, "side_channel_port": free_port()},
                logdir,
                connector=PUSH,
                **of,
            ),
        ],
        logdir,
    ) as (p, d):
        yield p, d, port


def assert_pushed_kv_of_another_prompt_changes_the_output(
    p: Engine, d: Engine, port: int, seed: int, length: int = 130
) -> None:
    """The prefill computes another prompt under the decode's request id: the decode, given
    that KV (and state), generates otherwise than computing its own prompt."""
    x, y = prompt(seed, length), prompt(seed + 1, length)
    _, (wrong,) = handoff(p, d, port, [y], [x], timeout=240)
    (local,) = decode(d, [x], [None])
    assert wrong["finish"] == "length", wrong
    assert wrong["logprobs"] != local["logprobs"], "the decode ignored the KV written to it"
