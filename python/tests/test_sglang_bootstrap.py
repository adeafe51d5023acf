"""The SGLang backend's question to a prefill's bootstrap server (where is its push registry),
against servers that answer garbage, trickle, or send without end: each is a clear error
within the time bound, never an exception of another kind or a stalled caller."""

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvxfer.sglang import bootstrap


def serve(answer: Callable[[socket.socket], None]) -> Iterator[int]:
    """A one-shot-per-connection TCP server on a free port running `answer` on each."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def loop() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(4096)
                try:
                    answer(conn)
                except OSError:
                    pass

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()


def reply(body: bytes, status: bytes = b"200 OK") -> Callable[[socket.socket], None]:
    return lambda c: c.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: x\r\n\r\n" + body)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[int]:
    yield from serve(request.param)


@pytest.mark.parametrize("server", [reply(b'{"port": 41000, "instance": "1"}')], indirect=True)
def test_a_good_reply_gives_the_port(server: int) -> None:
    status, body = bootstrap.get("127.0.0.1", server, "/kvxfer")
    assert (status, bootstrap.parse_reply(body)) == (200, 41000)


@pytest.mark.parametrize(
    ("body", "what"),
    [
        (b"[]", "a JSON list"),
        (b'"x"', "a JSON str"),
        (b'{"port": null}', "port is 'None'"),
        (b'{"port": true}', "port is 'True'"),
        (b'{"port": 70000}', "port is '70000'"),
        (b'{"port": "41000"}', "port is '41000'"),
        (b"\xff{", "not JSON"),
    ],
)
def test_a_reply_without_a_port_is_named(body: bytes, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        bootstrap.parse_reply(body)


def test_a_prefill_ranks_endpoint_reads_from_sglangs_route_reply() -> None:
    assert bootstrap.parse_rank(b'{"rank_ip": "10.0.0.2", "rank_port": 5000}') == (
        "10.0.0.2",
        5000,
    )
    for body, what in (
        (b'{"rank_port": 5000}', "rank_ip is 'None'"),
        (b'{"rank_ip": "", "rank_port": 5000}', "rank_ip is ''"),
        (b'{"rank_ip": "h", "rank_port": 0}', "rank_port is '0'"),
        (b'{"rank_ip": "h", "rank_port": true}', "rank_port is 'True'"),
        (b"[1]", "a JSON list"),
        (b"{", "not JSON"),
    ):
        with pytest.raises(ValueError, match=what):
            bootstrap.parse_rank(body)


def trickle(c: socket.socket) -> None:
    c.sendall(b"HTTP/1.1 200 OK\r\n")
    while True:
        c.sendall(b"x")
        time.sleep(0.05)


def endless(c: socket.socket) -> None:
    c.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    while True:
        c.sendall(b"0" * 65536)


@pytest.mark.parametrize("server", [trickle], indirect=True)
def test_a_trickling_server_times_out_on_the_whole_exchange(server: int) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="within 0.5 s"):
        bootstrap.get("127.0.0.1", server, "/kvxfer", timeout=0.5)
    assert time.monotonic() - t0 < 3  # each byte came well within any per-read timeout


@pytest.mark.parametrize("server", [endless], indirect=True)
def test_a_reply_without_end_is_cut_at_the_limit(server: int) -> None:
    with pytest.raises(ValueError, match="over 16384 bytes"):
        bootstrap.get("127.0.0.1", server, "/kvxfer")


@pytest.mark.parametrize("server", [lambda c: c.sendall(b"hello\r\n\r\n{}")], indirect=True)
def test_a_reply_that_is_not_http_is_named(server: int) -> None:
    with pytest.raises(ValueError, match="not HTTP"):
        bootstrap.get("127.0.0.1", server, "/kvxfer")
