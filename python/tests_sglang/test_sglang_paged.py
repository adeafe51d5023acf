"""A real SGLang prefill and decode with 16- and then 64-token pages (``--page-size``, as
several attention backends require) and the kvxfer backend over UCX, behind SGLang's router: prompts
whose last page is partly filled, alone and concurrently, give the plain run's tokens and
logprobs; the decode checks every room's content digests (the bytes in its own KV pages
against what the prefill wrote), and the negative control shows it uses the prefill's KV.
One engine configuration per page size, several cases against it."""

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import HEARTBEAT, PROMPTS, STARTUP, _usable_or_skip
from harness import (
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
class Paged:
    page: int
    prefill: Server
    decode: Server
    router: Router


@pytest.fixture(scope="module", params=[16, 64])
def paged(request: pytest.FixtureRequest, logdir: Path, reference: dict) -> Iterator[Paged]:
    _usable_or_skip("ucx")
    page = request.param
    boot = free_port()
    args = ("--page-size", str(page))  # after the common `--page-size 1`: it wins
    prefill = Server(
        "prefill",
        "0",
        logdir,
        transport="ucx",
        bootstrap_port=boot,
        args=args,
        name=f"prefill-paged{page}",
    )
    decode = Server(
        "decode",
        "1",
        logdir,
        transport="ucx",
        bootstrap_port=boot,
        env={**HEARTBEAT, "KVXFER_DIGEST": "1"},
        args=args,
        name=f"decode-paged{page}",
    )
    servers: list[Server | Router] = [prefill, decode]
    try:
        wait_healthy(servers, STARTUP)
        router = Router(prefill, decode, logdir, f"router-paged{page}")
        servers.append(router)
        wait_healthy([router], 120)
        yield Paged(page, prefill, decode, router)
    finally:
        for s in reversed(servers):
            s.close()


def assert_matches(reply: dict, ref: dict) -> None:
    ids, lps = tokens_and_logprobs(reply)
    assert ids == ref["output_ids"]
    assert np.allclose(lps, ref["logprobs"], atol=LOGPROB_TOLERANCE, rtol=0), (lps, ref["logprobs"])


def test_prompts_ending_in_a_partly_filled_page_equal_a_plain_run(
    paged: Paged, reference: dict
) -> None:
    assert any(len(p) % paged.page for p in PROMPTS), "a prompt whose last page is partly filled"
    assert any(len(p) % paged.page == 0 for p in PROMPTS), "and one that fills its pages"
    for ids in (PROMPT_A, PROMPT_B):
        r = post(paged.router.url, body(ids))
        assert r.status_code == 200, r.text
        assert_matches(r.json(), reference[tuple(ids)])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda ids: post(paged.router.url, body(ids)), PROMPTS))
    for ids, r in zip(PROMPTS, replies, strict=True):
        assert r.status_code == 200, r.text
        assert_matches(r.json(), reference[tuple(ids)])


def test_the_decode_continues_from_the_pages_the_prefill_wrote(
    paged: Paged, reference: dict
) -> None:
    """Negative control: the prefill computes prompt A, the decode is given prompt B under the
    same room; it never computes its prompt, so it continues A."""
    p, d = direct(paged.prefill, paged.decode, PROMPT_A, PROMPT_B, random.getrandbits(63))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["output_ids"] == reference[tuple(PROMPT_A)]["output_ids"]
    assert reference[tuple(PROMPT_A)]["output_ids"] != reference[tuple(PROMPT_B)]["output_ids"]
