"""A real SGLang prefill and decode with the kvxfer backend, behind SGLang's router: outputs
equal a plain run, the decode continues from the KV the prefill wrote, concurrent requests,
a refused out-of-range destination, and a prefill killed mid-request and restarted. Over UCX
(prefills found through their push registries) and NIXL (through etcd)."""

import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import pytest
import requests
from conftest import CLUSTER, ENGINE_ID, PROMPTS, Pair
from harness import (
    PROMPT_A,
    PROMPT_B,
    assert_matches,
    body,
    deferred_releases,
    direct,
    ended_in_error,
    post,
    wait_healthy,
)

import kvxfer


def room() -> int:
    return random.getrandbits(63)


def test_the_decode_through_the_router_equals_a_plain_run(pair: Pair, reference: dict) -> None:
    for ids in (PROMPT_A, PROMPT_B):
        r = post(pair.router.url, body(ids))
        assert r.status_code == 200, r.text
        assert_matches(r.json(), reference[tuple(ids)])
    assert reference[tuple(PROMPT_A)]["output_ids"] != reference[tuple(PROMPT_B)]["output_ids"]


def test_the_decode_continues_from_the_kv_the_prefill_wrote(pair: Pair, reference: dict) -> None:
    """Negative control: the prefill computes prompt A, the decode is given prompt B under the
    same room; it never computes its prompt, so it continues A."""
    p, d = direct(pair.prefill, pair.decode, PROMPT_A, PROMPT_B, room())
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["output_ids"] == reference[tuple(PROMPT_A)]["output_ids"]


def test_concurrent_requests_each_get_their_own_kv(pair: Pair, reference: dict) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda ids: post(pair.router.url, body(ids)), PROMPTS))
    for ids, r in zip(PROMPTS, replies, strict=True):
        assert r.status_code == 200, r.text
        assert_matches(r.json(), reference[tuple(ids)])


def _prefill_shape(pair: Pair) -> dict[str, Any]:
    m = re.search(r"kvxfer-layout: (\{.*\})", pair.prefill.log_text())
    assert m, "the prefill logs its layout"
    return json.loads(m.group(1))


def test_with_discovery_the_prefill_is_found_through_etcd(pair: Pair, reference: dict) -> None:
    """The NIXL pair's prefill rank registered in etcd under its engine id, and both sides
    say they go through etcd (the tests before and after this one ran their rooms so)."""
    if pair.etcd is None:
        pytest.skip("this pair finds its prefill through the push registry")
    watch = kvxfer.FleetWatch(pair.etcd.url, CLUSTER)
    try:
        ranks = watch.engine(ENGINE_ID)
        assert ranks is not None and [r[0] for r in ranks] == [(0, 0, 0)], ranks
    finally:
        watch.close()
    assert f"etcd cluster '{CLUSTER}' as '{ENGINE_ID}'" in pair.prefill.log_text()
    assert f"prefills through etcd cluster '{CLUSTER}'" in pair.decode.log_text()
    reply = post(pair.router.url, body(PROMPT_B))
    assert reply.status_code == 200, reply.text
    assert_matches(reply.json(), reference[tuple(PROMPT_B)])


class _OwnDecode(NamedTuple):
    decode: kvxfer.PushDecode
    kv: list[np.ndarray]
    aux: list[np.ndarray]
    registry_port: int


def _own_decode(pair: Pair, pages: int, name: str, digest: bool = False) -> _OwnDecode:
    """A decode rank in this process (kvxfer's push decode over zeroed buffers of `pages`
    pages, laid out as the prefill logs its own), and the prefill's push registry port."""
    shape = _prefill_shape(pair)
    block = shape["kv_heads"] * shape["head_dim"] * shape["tokens_per_block"]
    regions = 2 * shape["num_layers"]
    kv = [np.zeros(pages * block, dtype=np.uint8) for _ in range(regions)]
    aux = [np.zeros(4 * n, dtype=np.uint8) for n in shape["aux_item_lens"]]
    layout = {
        k: v
        for k, v in shape.items()
        if k not in ("aux_item_lens", "state_item_lens", "first_layer", "memory")
    }
    layout.update(num_blocks=pages, bases=[a.ctypes.data for a in kv])
    decode = kvxfer.PushDecode(
        f"{name}-{pair.transport}",
        pair.transport,
        layout,
        tp_rank=0,
        tp_size=1,
        aux=[(a.ctypes.data, n, 4) for a, n in zip(aux, shape["aux_item_lens"], strict=True)],
        discovery=None if pair.etcd is None else (pair.etcd.url, CLUSTER),
        digest=digest,
    )
    boot = pair.prefill.bootstrap_port
    port = requests.get(f"http://127.0.0.1:{boot}/kvxfer", timeout=5).json()["port"]
    return _OwnDecode(decode, kv, aux, port)


def test_a_destination_with_out_of_range_pages_is_refused_and_nothing_is_written(
    pair: Pair, reference: dict
) -> None:
    """A decode (this test, with kvxfer's push decode and buffers of 8 pages) asks for a room
    with pages past its registration: the prefill refuses it, ends the request in error, tells
    the decode, and writes nothing; then it keeps serving."""
    decode, kv, aux, port = _own_decode(pair, 8, "fake-decode")
    boot = pair.prefill.bootstrap_port
    r = room()
    reply: dict[str, requests.Response] = {}
    t = threading.Thread(
        target=lambda: reply.setdefault("p", post(pair.prefill.url, body(PROMPT_A, r, boot)))
    )
    t.start()
    decode.add_room(r, ("127.0.0.1", port), list(range(len(PROMPT_A))), aux_index=0)
    deadline = time.monotonic() + 60
    while decode.status(r) != 0:
        assert time.monotonic() < deadline, "the decode was never told"
        decode.poll()
        time.sleep(0.01)
    t.join(timeout=120)
    assert not t.is_alive(), "the prefill request never ended"
    assert ended_in_error(reply["p"]), reply["p"].text
    assert "out of range" in pair.prefill.log_text()
    assert not any(a.any() for a in kv + aux), "a byte was written"
    decode.shutdown()
    p, d = direct(pair.prefill, pair.decode, PROMPT_B, PROMPT_B, room())
    assert d.status_code == 200, d.text
    assert_matches(d.json(), reference[tuple(PROMPT_B)])


def test_content_digests_pass_as_written_and_catch_a_byte_changed_after_it_landed(
    pair: Pair, reference: dict
) -> None:
    """A decode rank in this process, checking content digests, receives prompt A's room from
    the real prefill, which digests what it writes because the decode asked. As written, the
    pages fold to the prefill's digests and the room succeeds; with one byte flipped after
    the data landed and before the decode looked (a faulty link or memory), the room fails on
    a digest mismatch, counted. The prefill serves on either way."""
    pages = len(PROMPT_A)  # --page-size 1
    boot = pair.prefill.bootstrap_port
    for corrupt in (False, True):
        own = _own_decode(pair, pages, f"digest-decode-{int(corrupt)}", digest=True)
        decode, r = own.decode, room()
        reply: dict[str, requests.Response] = {}

        def ask(r: int = r, reply: dict[str, requests.Response] = reply) -> None:
            reply["p"] = post(pair.prefill.url, body(PROMPT_A, r, boot))

        decode.add_room(r, ("127.0.0.1", own.registry_port), list(range(pages)), aux_index=0)
        # Polled through the bootstrap only, before the prefill has the request: the rest
        # lands while this decode does not look, so no check can start before the flip.
        deadline = time.monotonic() + 60
        while (decode.status(r) or 0) < 2:
            assert decode.status(r) != 0, decode.error(r)
            assert time.monotonic() < deadline, "the bootstrap never ended"
            decode.poll()
            time.sleep(0.01)
        assert decode.status(r) == 2, "the room went on before the prefill had its request"
        t = threading.Thread(target=ask)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), "the prefill request never ended"
        assert reply["p"].status_code == 200 and not ended_in_error(reply["p"]), reply["p"].text
        assert own.kv[0].any(), "the prefill wrote"
        if corrupt:
            own.kv[0][0] ^= 1
        while decode.status(r) not in (0, 4):
            assert time.monotonic() < deadline, "the room never ended"
            decode.poll()
            time.sleep(0.01)
        m = decode.take_metrics()
        if corrupt:
            assert decode.status(r) == 0
            assert "content digest mismatch" in (decode.error(r) or ""), decode.error(r)
            assert (m["verified_rooms"], m["digest_mismatches"]) == (0, 1), m
        else:
            assert decode.status(r) == 4, decode.error(r)
            assert (m["verified_rooms"], m["digest_mismatches"]) == (1, 0), m
        decode.shutdown()
    p, d = direct(pair.prefill, pair.decode, PROMPT_B, PROMPT_B, room())
    assert d.status_code == 200, d.text
    assert_matches(d.json(), reference[tuple(PROMPT_B)])
    if pair.transport == "ucx":
        assert "content digests checked" in pair.decode.log_text(), "the pair's decode checks"


def test_an_aborted_decode_request_holds_its_pages_until_the_prefill_acknowledged(
    pair: Pair, reference: dict
) -> None:
    """A decode request aborted while its destination sits at the prefill (which has not
    received its request and is idle): SGLang's decode holds the pages (its deferred
    release) until kvxfer says no prefill rank can still write into them; the prefill rank
    releases its WRITEs and acknowledges without its engine polling it, so the pages come
    back drained within seconds, not at SGLang's 30 s timeout. A prefill request for that
    room afterwards writes nothing and fails; the decode keeps serving."""
    before = deferred_releases(pair.decode.url)
    r, rid = room(), f"abort-{room()}"
    boot = pair.prefill.bootstrap_port
    reply: dict[str, requests.Response] = {}
    t = threading.Thread(
        target=lambda: reply.setdefault(
            "d", post(pair.decode.url, body(PROMPT_A, r, boot, rid=rid))
        )
    )
    t.start()
    time.sleep(3)  # the decode has bootstrapped and sent its destination; no data comes
    assert t.is_alive(), "the request did not wait"
    aborted = time.monotonic()
    requests.post(f"{pair.decode.url}/abort_request", json={"rid": rid}, timeout=10)
    t.join(timeout=60)
    assert not t.is_alive(), "the aborted request never ended"
    assert ended_in_error(reply["d"]), reply["d"].text
    while deferred_releases(pair.decode.url).get("drained", 0) <= before.get("drained", 0):
        assert time.monotonic() - aborted < 20, (
            f"the pages were not released drained: {deferred_releases(pair.decode.url)}"
        )
        time.sleep(0.2)
    took = time.monotonic() - aborted
    assert deferred_releases(pair.decode.url).get("timeout", 0) == before.get("timeout", 0)
    print(f"{pair.transport}: the aborted room's pages came back drained {took:.1f} s later")
    late = post(pair.prefill.url, body(PROMPT_A, r, boot))
    assert ended_in_error(late), late.text
    p, d = direct(pair.prefill, pair.decode, PROMPT_B, PROMPT_B, room())
    assert d.status_code == 200, d.text
    assert_matches(d.json(), reference[tuple(PROMPT_B)])


def test_a_killed_prefill_fails_the_waiting_request_and_the_decode_keeps_serving(
    pair: Pair, reference: dict
) -> None:
    """Runs last on its pair: it kills the prefill (the router's prefill), then starts
    another on the same bootstrap port. The decode's liveness probes find it dead: over UCX
    its push registry stops answering, over NIXL its keys leave etcd (2 s leases); the
    restarted prefill registers again under a new instance, which the decode picks up."""
    r = room()
    reply: dict[str, Any] = {}

    def wait_on_decode() -> None:
        reply["d"] = post(pair.decode.url, body(PROMPT_A, r, pair.prefill.bootstrap_port), 300)
        reply["t"] = time.monotonic()

    t = threading.Thread(target=wait_on_decode)
    t.start()
    time.sleep(3)  # the decode has bootstrapped and sent its destination; no data comes
    assert t.is_alive(), "the request did not wait"
    killed = time.monotonic()
    pair.prefill.kill()
    t.join(timeout=120)
    assert not t.is_alive(), "the decode's request never ended"
    took = reply["t"] - killed
    assert ended_in_error(reply["d"]), reply["d"].text
    # Two missed heartbeats 2 s apart, each probe bounded by 2 s: well under 30 s.
    assert took < 30, f"failed after {took:.1f} s"
    if pair.etcd is not None:
        assert pair.etcd.keys(f"/kvxfer/v1/{CLUSTER}/engines/prefill/{ENGINE_ID}/") == 0
    print(f"{pair.transport}: the waiting request failed {took:.1f} s after the prefill died")
    assert pair.decode.alive()
    fresh = pair.start_prefill(f"prefill-{pair.transport}-restarted")
    wait_healthy([fresh], 900)
    p, d = direct(fresh, pair.decode, PROMPT_A, PROMPT_A, room())
    assert d.status_code == 200, d.text
    assert_matches(d.json(), reference[tuple(PROMPT_A)])
