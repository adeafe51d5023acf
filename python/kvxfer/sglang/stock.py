"""A kvxfer decode's rooms at stock SGLang prefills (SGLang 0.5.23's own nixl backend), for
fleets that mix the two backends.

Such a prefill never learns of kvxfer: the decode registers its NIXL agent and buffers with
each prefill rank it needs and names each room's pages in SGLang's own ZMQ messages (built by
``kvxfer._kvxfer.sglang_nixl_*``); the prefill rank WRITEs them and answers ``KV_STATUS`` once
its WRITEs completed (or the room failed), and ``ABORT_ACK`` to an abort once none can land
any more. This module keeps what those answers mean for each room, without I/O and without
importing SGLang, so it is tested on its own: :func:`targets` (which ranks a decode rank asks)
and :class:`StockRooms` (each room's status, and when its pages may be handed back).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

FAILED, WAITING, TRANSFERRING, SUCCESS = 0, 2, 3, 4
"""SGLang's ``KVPoll`` values used here."""


class Refused(ValueError):
    """A stock prefill this decode rank cannot take KV from; the message says why."""


def targets(prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[int, ...]:
    """The prefill TP ranks decode rank `decode_rank` asks for its rooms' KV. Equal TP sizes
    only: SGLang's nixl backend writes other TP sizes into GPU memory only (on host memory
    its prefill's bootstrap thread dies on the registration), and kvxfer's decode is host
    memory where it pairs with NIXL peers."""
    if prefill_tp != decode_tp:
        raise Refused(
            f"a stock SGLang nixl prefill of TP {prefill_tp} and this decode of TP {decode_tp}: "
            "kvxfer takes KV from a stock prefill at equal TP sizes only"
        )
    return (decode_rank,)


@dataclass
class _Room:
    prefill: str
    ranks: tuple[int, ...]
    deadline: float
    succeeded: set[int] = field(default_factory=set)
    answered: set[int] = field(default_factory=set)
    failure: str | None = None
    generation: int | None = None
    acked: set[int] = field(default_factory=set)
    dead: bool = False


class StockRooms:
    """Rooms this decode rank sent to stock prefill ranks, fed their answers (from the
    rank's socket, on another thread: every call takes a lock).

    A room succeeds once each rank it was sent to answered Success, and fails on the first
    Failure, when no answer came within `waiting_timeout` seconds, or when its prefill was
    declared dead (:meth:`prefill_died`). Its pages may be handed back (:meth:`drained`)
    once it succeeded, every rank it was sent to either answered (a rank answers only after
    its WRITEs settled) or acknowledged the decode's abort, or its prefill was declared dead
    (as kvxfer's own prefills are: a dead process writes nothing)."""

    def __init__(self, waiting_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout = waiting_timeout
        self._clock = clock
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()

    def __contains__(self, room: object) -> bool:
        with self._lock:
            return room in self._rooms

    def sent(self, room: int, prefill: str, ranks: Sequence[int]) -> None:
        """The room's destination went to `ranks` of the prefill at `prefill`."""
        with self._lock:
            self._rooms[room] = _Room(prefill, tuple(ranks), self._clock() + self._timeout)

    def prefill_died(self, prefill: str, reason: str) -> int:
        """Fails every unfinished room of the prefill at `prefill` with `reason`; their
        pages may be handed back. Returns how many failed."""
        failed = 0
        with self._lock:
            for r in self._rooms.values():
                if r.prefill != prefill or r.succeeded >= set(r.ranks):
                    continue
                r.dead = True
                if r.failure is None:
                    r.failure = reason
                    failed += 1
        return failed

    def on_status(self, room: int, status: int, rank: int, reason: str) -> bool:
        """A ``KV_STATUS`` from prefill `rank`; False for a room or rank not expected."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or rank not in r.ranks:
                return False
            r.answered.add(rank)
            if status == SUCCESS:
                r.succeeded.add(rank)
            elif status == FAILED and r.failure is None:
                r.failure = f"stock SGLang prefill rank {rank}: {reason or 'failed'}"
            return True

    def on_ack(self, room: int, rank: int, generation: int | None) -> bool:
        """An ``ABORT_ACK``; False unless it answers this room's abort."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.generation is None or generation != r.generation:
                return False
            if rank not in r.ranks:
                return False
            r.acked.add(rank)
            return True

    def status(self, room: int) -> tuple[int, str | None]:
        """The room's ``KVPoll`` value and, if it failed, why."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return FAILED, "the room is gone"
            if r.failure is not None:
                return FAILED, r.failure
            if r.succeeded >= set(r.ranks):
                return SUCCESS, None
            if r.generation is not None:
                return FAILED, "aborted by the decode"
            if self._clock() > r.deadline:
                r.failure = f"no status from the stock SGLang prefill within {self._timeout} s"
                return FAILED, r.failure
            return TRANSFERRING, None

    def abort(self, room: int, generation: int) -> tuple[int, ...]:
        """Gives up on the room: the ranks to send an ``ABORT`` with `generation` (none for a
        room unknown, succeeded, or aborted before)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.generation is not None or r.succeeded >= set(r.ranks):
                return ()
            r.generation = generation
            return r.ranks

    def drained(self, room: int) -> bool:
        """Whether no prefill rank can still write into the room's pages (True for a room
        unknown here)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.dead or r.succeeded >= set(r.ranks):
                return True
            return all(k in r.answered or k in r.acked for k in r.ranks)

    def forget(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)
