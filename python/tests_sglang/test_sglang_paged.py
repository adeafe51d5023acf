"""A real SGLang prefill and decode with 16- and then 64-token pages (``--page-size``, as
several attention backends require) and the kvxfer backend over UCX, behind SGLang's router,
the decode keeping its radix cache (``--disaggregation-decode-enable-radix-cache``): prompts
whose last page is partly filled, alone and concurrently, give the plain run's tokens and
logprobs; a prompt the decode holds the first pages of is written only past them; the decode
checks every room's content digests (the bytes in its own KV pages against what the prefill
wrote), and the negative control (first, while the decode's cache is empty) shows it uses
the prefill's KV. One engine configuration per page size, several cases against it."""

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import HEARTBEAT, PROMPTS, STARTUP, _usable_or_skip
from harness import (
    PROMPT_A,
    PROMPT_B,
    Router,
    Server,
    assert_matches,
    body,
    direct,
    free_port,
    post,
    wait_healthy,
)


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
        args=(*args, "--disaggregation-decode-enable-radix-cache"),
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


def test_the_decode_continues_from_the_pages_the_prefill_wrote(
    paged: Paged, reference: dict
) -> None:
    """Negative control: the prefill computes prompt A, the decode is given another prompt of
    A's length under the same room; it never computes its prompt, so it continues A. (The
    decode's radix cache then holds A's KV under that prompt's tokens, as it would after any
    such request: no other test sends that prompt.)"""
    other = [(i * 29 + 17) % 1000 for i in range(len(PROMPT_A))]
    assert all(other[:8] != p[:8] for p in PROMPTS)
    p, d = direct(paged.prefill, paged.decode, PROMPT_A, other, random.getrandbits(63))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["output_ids"] == reference[tuple(PROMPT_A)]["output_ids"]


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


def test_a_prompt_the_decode_holds_the_first_pages_of_is_written_only_past_them(
    paged: Paged, reference: dict
) -> None:
    """The decode's radix cache holds prompt A's full pages (A ran before): it names them as
    its prefix (SGLang's ``decode_prefix_len``), gives pages for the rest only, and the
    prefill, told the prefix by kvxfer, sends only those (otherwise the page counts differ
    and the room fails); the tokens are the plain run's."""
    post(paged.router.url, body(PROMPT_A))
    r = post(paged.router.url, body(PROMPT_A))
    assert r.status_code == 200, r.text
    assert_matches(r.json(), reference[tuple(PROMPT_A)])
    held = len(PROMPT_A) // paged.page * paged.page
    assert held > 0
    assert r.json()["meta_info"]["cached_tokens"] == held, r.json()["meta_info"]
