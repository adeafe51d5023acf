"""Mixed fleets: a prefill running kvxfer's backend over NIXL and a decode running SGLang's
own nixl backend, unmodified, on the same SGLang, behind SGLang's router. The stock decode
bootstraps from the kvxfer prefill's bootstrap server, registers its NIXL agent and names
each room's pages in SGLang's own ZMQ messages; the kvxfer prefill WRITEs the pages and the
aux row and tells it ``KV_STATUS``. Outputs equal a plain run's (tokens and logprobs), alone
and concurrently; the negative control shows the decode continues from the KV the prefill
wrote; an aborted decode request gets its pages back drained (kvxfer's ``ABORT_ACK``), not
at SGLang's 30 s timeout. One engine configuration, several cases against it."""

import random
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
from conftest import HEARTBEAT, PROMPTS, STARTUP, _usable_or_skip
from harness import (
    NIXL_DRAM,
    NIXL_ENV,
    PROMPT_A,
    PROMPT_B,
    Router,
    Server,
    body,
    direct,
    free_port,
    post,
    tokens_and_logprobs,
    wait_healthy,
)

LOGPROB_TOLERANCE = 1e-4


@dataclass
class Mixed:
    prefill: Server
    decode: Server
    router: Router


@pytest.fixture(scope="module")
def mixed(logdir: Path, reference: dict) -> Iterator[Mixed]:
    _usable_or_skip("nixl")
    boot = free_port()
    # Both on the engine's own NIXL (the wheel SGLang imports): NIXL peers must run the
    # same release.
    prefill = Server(
        "prefill",
        "0",
        logdir,
        transport="nixl",
        bootstrap_port=boot,
        unset=NIXL_ENV,
        name="prefill-kvxfer-mixed",
    )
    decode = Server(
        "decode",
        "1",
        logdir,
        transport="nixl",
        bootstrap_port=boot,
        backend="nixl",
        paths=(NIXL_DRAM,),
        unset=NIXL_ENV,
        env=HEARTBEAT,
        args=("--enable-metrics",),
        name="decode-stock-mixed",
    )
    servers: list[Server | Router] = [prefill, decode]
    try:
        wait_healthy(servers, STARTUP)
        router = Router(prefill, decode, logdir, "router-mixed")
        servers.append(router)
        wait_healthy([router], 120)
        yield Mixed(prefill, decode, router)
    finally:
        for s in reversed(servers):
            s.close()


def assert_matches(reply: dict, ref: dict) -> None:
    ids, lps = tokens_and_logprobs(reply)
    assert ids == ref["output_ids"]
    assert np.allclose(lps, ref["logprobs"], atol=LOGPROB_TOLERANCE, rtol=0), (lps, ref["logprobs"])


def test_a_stock_decode_through_the_router_equals_a_plain_run(
    mixed: Mixed, reference: dict
) -> None:
    log = mixed.prefill.log_text()
    assert "stock SGLang nixl decodes on ZMQ port" in log, "the prefill serves stock decodes"
    for ids in (PROMPT_A, PROMPT_B):
        r = post(mixed.router.url, body(ids))
        assert r.status_code == 200, r.text
        assert_matches(r.json(), reference[tuple(ids)])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda ids: post(mixed.router.url, body(ids)), PROMPTS))
    for ids, r in zip(PROMPTS, replies, strict=True):
        assert r.status_code == 200, r.text
        assert_matches(r.json(), reference[tuple(ids)])
    assert "refused a stock SGLang decode" not in mixed.prefill.log_text()


def test_the_stock_decode_continues_from_the_kv_the_kvxfer_prefill_wrote(
    mixed: Mixed, reference: dict
) -> None:
    """Negative control: the prefill computes prompt A, the decode is given prompt B under the
    same room; it never computes its prompt, so it continues A."""
    p, d = direct(mixed.prefill, mixed.decode, PROMPT_A, PROMPT_B, random.getrandbits(63))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["output_ids"] == reference[tuple(PROMPT_A)]["output_ids"]


def _releases(decode_url: str) -> dict[str, float]:
    """SGLang's count of the decode's deferred page releases, by outcome."""
    text = requests.get(f"{decode_url}/metrics", timeout=5).text
    found: dict[str, float] = {}
    for m in re.finditer(
        r'^sglang:decode_deferred_kv_release_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$',
        text,
        re.M,
    ):
        found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))
    return found


def test_an_aborted_stock_decode_request_is_acknowledged_by_the_kvxfer_prefill(
    mixed: Mixed, reference: dict
) -> None:
    """The stock decode aborts a request whose destination waits at the idle kvxfer prefill:
    it holds the pages until the prefill rank says none of its WRITEs can land
    (``ABORT_ACK``), which kvxfer sends once it released them: the pages come back drained
    within seconds, not at SGLang's 30 s timeout. The decode keeps serving."""
    before = _releases(mixed.decode.url)
    room, rid = random.getrandbits(63), f"abort-{random.getrandbits(32)}"
    boot = mixed.prefill.bootstrap_port
    reply: dict[str, requests.Response] = {}
    t = threading.Thread(
        target=lambda: reply.setdefault(
            "d", post(mixed.decode.url, body(PROMPT_A, room, boot, rid=rid))
        )
    )
    t.start()
    time.sleep(3)  # bootstrapped, its destination sent; no prefill request comes
    assert t.is_alive(), "the request did not wait"
    aborted = time.monotonic()
    requests.post(f"{mixed.decode.url}/abort_request", json={"rid": rid}, timeout=10)
    t.join(timeout=60)
    assert not t.is_alive(), "the aborted request never ended"
    while _releases(mixed.decode.url).get("drained", 0) <= before.get("drained", 0):
        assert time.monotonic() - aborted < 20, (
            f"the pages were not released drained: {_releases(mixed.decode.url)}"
        )
        time.sleep(0.2)
    assert _releases(mixed.decode.url).get("timeout", 0) == before.get("timeout", 0)
    p, d = direct(mixed.prefill, mixed.decode, PROMPT_B, PROMPT_B, random.getrandbits(63))
    assert d.status_code == 200, d.text
    assert_matches(d.json(), reference[tuple(PROMPT_B)])
