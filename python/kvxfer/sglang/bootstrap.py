"""Asking a prefill's bootstrap server where its kvxfer push registry listens.

One HTTP GET bounded in time and size, its reply validated: a server that answers garbage,
trickles bytes or never stops sends fails the request that asked, within `TIMEOUT`, instead
of stalling the decode's scheduler or raising out of it. No SGLang import, so it is tested
on its own.
"""

from __future__ import annotations

import json
import socket
import time

TIMEOUT = 5.0
"""Seconds for the whole exchange: connecting, asking, and the last byte of the reply."""

REPLY_LIMIT = 16 * 1024
"""Bytes of a reply, headers included (ours is under 200)."""


def parse_reply(body: bytes) -> int:
    """The registry port in a `/kvxfer` reply body (`{"port": P, ...}`); raises ValueError
    naming what is wrong."""
    try:
        reply = json.loads(body)
    except ValueError as e:  # UnicodeDecodeError is one
        raise ValueError(f"reply is not JSON ({e})") from None
    if not isinstance(reply, dict):
        raise ValueError(f"reply is a JSON {type(reply).__name__}, expected an object")
    port = reply.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"reply's port is {str(port)[:40]!r}, expected 1 to 65535")
    return port


def parse_rank(body: bytes) -> tuple[str, int]:
    """A prefill rank's ZMQ endpoint in SGLang's `/route` reply (`{"rank_ip": H,
    "rank_port": P}`); raises ValueError naming what is wrong."""
    try:
        reply = json.loads(body)
    except ValueError as e:
        raise ValueError(f"reply is not JSON ({e})") from None
    if not isinstance(reply, dict):
        raise ValueError(f"reply is a JSON {type(reply).__name__}, expected an object")
    host, port = reply.get("rank_ip"), reply.get("rank_port")
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        raise ValueError(f"reply's rank_ip is {str(host)[:40]!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"reply's rank_port is {str(port)[:40]!r}, expected 1 to 65535")
    return host, port


def get(
    host: str, port: int, path: str, timeout: float = TIMEOUT, limit: int = REPLY_LIMIT
) -> tuple[int, bytes]:
    """`GET path` from `host:port` over HTTP/1.0 (the server closes when done): the status
    and the body. Raises OSError (TimeoutError past `timeout` in all) or ValueError (a reply
    over `limit` bytes or not HTTP)."""
    end = time.monotonic() + timeout

    def left() -> float:
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no whole reply from {host}:{port} within {timeout} s")
        return remaining

    data = bytearray()
    try:
        with socket.create_connection((host, port), timeout=left()) as s:
            s.settimeout(left())
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode())
            while True:
                s.settimeout(left())
                chunk = s.recv(limit + 1 - len(data))
                if not chunk:
                    break
                data += chunk
                if len(data) > limit:
                    raise ValueError(f"reply from {host}:{port} is over {limit} bytes")
    except TimeoutError:  # a socket's own says only "timed out"
        raise TimeoutError(f"no whole reply from {host}:{port} within {timeout} s") from None
    head, sep, body = bytes(data).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/") or not status[1].isdigit():
        raise ValueError(f"reply from {host}:{port} is not HTTP: {bytes(data[:60])!r}")
    return int(status[1]), body
