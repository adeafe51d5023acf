"""Mixed fleets, on the same SGLang behind SGLang's router: a prefill running kvxfer's backend
over NIXL with a decode running SGLang's own nixl backend, unmodified, and the reverse.

A stock decode bootstraps from the kvxfer prefill's bootstrap server, registers its NIXL agent
and names each room's pages in SGLang's own ZMQ messages; the kvxfer prefill WRITEs the pages
and the aux row and tells it ``KV_STATUS``. A kvxfer decode finds no kvxfer registry at a
stock prefill's bootstrap server, so it speaks SGLang's messages to its ranks, and the stock
prefill WRITEs into the memory kvxfer registered. Either way: outputs equal a plain run's
(tokens and logprobs), alone and concurrently; the negative control shows the decode
continues from the KV the prefill wrote; an aborted decode request gets its pages back
drained (``ABORT``/``ABORT_ACK``), not at SGLang's 30 s timeout. One engine configuration
per direction, several cases against it."""

import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import HEARTBEAT, PROMPTS, STARTUP, _usable_or_skip
from harness import (
    HERE,
    MODEL,
    NIXL_DRAM,
    NIXL_ENV,
    PROMPT_A,
    PROMPT_B,
    Router,
    Server,
    assert_matches,
    body,
    deferred_releases,
    direct,
    ended_in_error,
    free_port,
    post,
    wait_healthy,
)

MAKE_MODEL = HERE.parent / "tests_vllm" / "make_model.py"


@dataclass
class Mixed:
    stock: str
    prefill: Server
    decode: Server
    router: Router
    logdir: Path
    # Beside a kvxfer prefill: a stock decode of a model with another KV layout.
    other: Server | None = None


def _server(
    role: str, stock: bool, boot: int, logdir: Path, suffix: str = "", model: Path = MODEL
) -> Server:
    """A server on the engine's own NIXL (the wheel SGLang imports: NIXL peers must run the
    same release), running SGLang's nixl backend if `stock`, else kvxfer's."""
    name = f"{role}-{'stock' if stock else 'kvxfer'}-mixed{suffix}"
    extra: dict[str, Any] = {"backend": "nixl", "paths": (NIXL_DRAM,)} if stock else {}
    if role == "decode":
        extra |= {"env": HEARTBEAT, "args": ("--enable-metrics",)}
    cpus = "0" if role == "prefill" else "1"
    return Server(
        role,
        cpus,
        logdir,
        transport="nixl",
        bootstrap_port=boot,
        unset=NIXL_ENV,
        name=name,
        model=model,
        **extra,
    )


@pytest.fixture(scope="module", params=["decode", "prefill"])
def mixed(request: pytest.FixtureRequest, logdir: Path, reference: dict) -> Iterator[Mixed]:
    """`decode`: a kvxfer prefill and a stock decode; `prefill`: a stock prefill and a
    kvxfer decode."""
    _usable_or_skip("nixl")
    boot = free_port()
    stock = request.param
    prefill = _server("prefill", stock == "prefill", boot, logdir)
    decode = _server("decode", stock == "decode", boot, logdir)
    servers: list[Server | Router] = [prefill, decode]
    other = None
    if stock == "decode":
        # The same model with one KV head instead of two: pages of another layout.
        kv1 = logdir / "tiny-kv1"
        if not (kv1 / "config.json").exists():
            subprocess.run(
                [sys.executable, str(MAKE_MODEL), str(kv1), "--preset", "tiny-kv1"], check=True
            )
        other = _server("decode", True, boot, logdir, "-kv1", kv1)
        servers.append(other)
    try:
        wait_healthy(servers, STARTUP)
        router = Router(prefill, decode, logdir, f"router-mixed-{stock}")
        servers.append(router)
        wait_healthy([router], 120)
        mixed = Mixed(stock, prefill, decode, router, logdir, other)
        yield mixed
        servers.append(mixed.prefill)  # restarted by a test
    finally:
        for s in reversed(servers):
            s.close()


def test_through_the_router_the_outputs_equal_a_plain_run(mixed: Mixed, reference: dict) -> None:
    kvxfer_side = mixed.prefill if mixed.stock == "decode" else mixed.decode
    says = {"decode": "stock SGLang nixl decodes on ZMQ port", "prefill": "stock SGLang nixl"}
    assert says[mixed.stock] in kvxfer_side.log_text(), "kvxfer serves the stock side"
    for ids in (PROMPT_A, PROMPT_B):
        r = post(mixed.router.url, body(ids))
        assert r.status_code == 200, r.text
        assert_matches(r.json(), reference[tuple(ids)])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda ids: post(mixed.router.url, body(ids)), PROMPTS))
    for ids, r in zip(PROMPTS, replies, strict=True):
        assert r.status_code == 200, r.text
        assert_matches(r.json(), reference[tuple(ids)])
    if mixed.stock == "prefill":
        assert "refused a" not in kvxfer_side.log_text()
    if mixed.stock == "prefill":
        assert "is a stock SGLang prefill" in mixed.decode.log_text()


def test_a_stock_decode_of_another_kv_layout_is_refused_naming_the_factor(
    mixed: Mixed, reference: dict
) -> None:
    """A stock decode whose model has one KV head (the prefill's has two) registers with the
    kvxfer prefill: the registration is refused, naming the heads, and the decode's room is
    answered Failed at once (not after SGLang's waiting timeout); the prefill keeps serving."""
    if mixed.other is None:
        pytest.skip("a stock decode beside a kvxfer prefill only")
    start = time.monotonic()
    r = post(mixed.other.url, body(PROMPT_A, random.getrandbits(63), mixed.prefill.bootstrap_port))
    took = time.monotonic() - start
    assert ended_in_error(r), r.text
    assert took < 30, f"failed after {took:.1f} s"
    log = mixed.prefill.log_text()
    refusal = re.search(r"refused a stock SGLang decode's message: (.*)", log)
    assert refusal, "the prefill logs the refusal"
    assert "1 KV heads per rank, but 2 heads over TP 1" in refusal.group(1), refusal.group(1)
    # ... and the stock decode was told why (its room's failure).
    assert "its registration was refused" in mixed.other.log_text()
    ok = post(mixed.router.url, body(PROMPT_B))
    assert ok.status_code == 200, ok.text
    assert_matches(ok.json(), reference[tuple(PROMPT_B)])


def test_the_decode_continues_from_the_kv_the_prefill_wrote(mixed: Mixed, reference: dict) -> None:
    """Negative control: the prefill computes prompt A, the decode is given prompt B under the
    same room; it never computes its prompt, so it continues A."""
    p, d = direct(mixed.prefill, mixed.decode, PROMPT_A, PROMPT_B, random.getrandbits(63))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["output_ids"] == reference[tuple(PROMPT_A)]["output_ids"]


def test_an_aborted_decode_request_is_acknowledged_and_its_pages_come_back_drained(
    mixed: Mixed, reference: dict
) -> None:
    """The decode aborts a request whose destination waits at the idle prefill: it holds the
    pages until the prefill rank says none of its WRITEs can land (``ABORT_ACK``, sent once
    it released them): the pages come back drained within seconds, not at SGLang's 30 s
    timeout. The decode keeps serving."""
    before = deferred_releases(mixed.decode.url)
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
    while deferred_releases(mixed.decode.url).get("drained", 0) <= before.get("drained", 0):
        assert time.monotonic() - aborted < 20, (
            f"the pages were not released drained: {deferred_releases(mixed.decode.url)}"
        )
        time.sleep(0.2)
    assert deferred_releases(mixed.decode.url).get("timeout", 0) == before.get("timeout", 0)
    p, d = direct(mixed.prefill, mixed.decode, PROMPT_B, PROMPT_B, random.getrandbits(63))
    assert d.status_code == 200, d.text
    assert_matches(d.json(), reference[tuple(PROMPT_B)])


def test_a_killed_stock_prefill_fails_the_waiting_request_and_a_restarted_one_serves(
    mixed: Mixed, reference: dict
) -> None:
    """Runs last on its pair, with a stock prefill and a kvxfer decode: the prefill is killed
    while a decode request waits on it; the decode's probes of its bootstrap server miss
    (every 2 s, 2 misses), the request fails well before SGLang's waiting timeout, and a
    prefill restarted on the same bootstrap port (new ranks, new ZMQ ports) serves the
    next request: the decode bootstrapped and registered again."""
    if mixed.stock != "prefill":
        pytest.skip("the decode's liveness probes of a stock prefill are kvxfer's here only")
    room = random.getrandbits(63)
    reply: dict[str, Any] = {}

    def wait_on_decode() -> None:
        reply["d"] = post(mixed.decode.url, body(PROMPT_A, room, mixed.prefill.bootstrap_port), 300)
        reply["t"] = time.monotonic()

    t = threading.Thread(target=wait_on_decode)
    t.start()
    time.sleep(3)  # bootstrapped, its destination sent; no prefill request comes
    assert t.is_alive(), "the request did not wait"
    killed = time.monotonic()
    mixed.prefill.kill()
    t.join(timeout=120)
    assert not t.is_alive(), "the decode's request never ended"
    took = reply["t"] - killed
    assert ended_in_error(reply["d"]), reply["d"].text
    assert took < 30, f"failed after {took:.1f} s"
    assert "missed 2 heartbeats" in mixed.decode.log_text()
    mixed.prefill.close()
    mixed.prefill = _server(
        "prefill", True, mixed.prefill.bootstrap_port, mixed.logdir, "-restarted"
    )
    wait_healthy([mixed.prefill], STARTUP)
    p, d = direct(mixed.prefill, mixed.decode, PROMPT_A, PROMPT_A, random.getrandbits(63))
    assert d.status_code == 200, d.text
    assert_matches(d.json(), reference[tuple(PROMPT_A)])
