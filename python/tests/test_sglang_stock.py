"""A kvxfer decode's rooms at stock SGLang nixl prefills (kvxfer.sglang.stock), without SGLang,
and SGLang's frames as kvxfer's bindings build and read them."""

import struct

import pytest

import kvxfer
from kvxfer import _kvxfer as ext
from kvxfer.sglang.stock import FAILED, SUCCESS, TRANSFERRING, Refused, StockRooms, targets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_decode_rank_asks_the_prefill_rank_of_its_own_tp_rank_and_only_at_equal_tp() -> None:
    assert targets(2, 2, 1) == (1,)
    with pytest.raises(Refused, match="of TP 1 and this decode of TP 2: .* equal TP sizes only"):
        targets(1, 2, 0)


def test_a_room_succeeds_once_every_rank_said_so_and_fails_on_the_first_failure() -> None:
    rooms = StockRooms(30.0, Clock())
    rooms.sent(7, "p:1", (0, 1))
    assert rooms.status(7) == (TRANSFERRING, None)
    assert rooms.on_status(7, SUCCESS, 0, "")
    assert rooms.status(7) == (TRANSFERRING, None)
    assert not rooms.on_status(7, SUCCESS, 5, ""), "a rank the room was not sent to"
    assert not rooms.on_status(8, SUCCESS, 0, ""), "a room not sent"
    assert rooms.on_status(7, SUCCESS, 1, "")
    assert rooms.status(7) == (SUCCESS, None)
    assert rooms.drained(7)
    rooms.sent(9, "p:1", (0, 1))
    rooms.on_status(9, FAILED, 1, "page 4 out of range")
    rooms.on_status(9, SUCCESS, 0, "")
    assert rooms.status(9) == (FAILED, "stock SGLang prefill rank 1: page 4 out of range")
    assert "9" not in rooms and 9 in rooms
    rooms.forget(9)
    assert 9 not in rooms
    assert rooms.status(9) == (FAILED, "the room is gone")


def test_a_room_no_rank_answers_fails_at_the_waiting_timeout() -> None:
    clock = Clock()
    rooms = StockRooms(30.0, clock)
    rooms.sent(7, "p:1", (0,))
    clock.now += 30.0
    assert rooms.status(7) == (TRANSFERRING, None)
    clock.now += 0.1
    assert rooms.status(7) == (FAILED, "no status from the stock SGLang prefill within 30.0 s")
    assert not rooms.drained(7), "the prefill may still write: the pages wait for its ack"


def test_an_aborted_rooms_pages_come_back_once_every_rank_acked_or_answered() -> None:
    rooms = StockRooms(30.0, Clock())
    rooms.sent(7, "p:1", (0, 1))
    assert rooms.abort(7, 3) == (0, 1)
    assert rooms.abort(7, 4) == (), "aborted once"
    assert rooms.status(7) == (FAILED, "aborted by the decode")
    assert not rooms.drained(7)
    assert not rooms.on_ack(7, 0, 2), "another abort's generation"
    assert not rooms.on_ack(7, 0, None)
    assert rooms.on_ack(7, 0, 3)
    assert not rooms.drained(7), "rank 1 may still write"
    rooms.on_status(7, FAILED, 1, "aborted")
    assert rooms.drained(7), "rank 1 answered: its WRITEs settled"
    rooms.sent(8, "p:1", (0,))
    rooms.on_status(8, SUCCESS, 0, "")
    assert rooms.abort(8, 1) == (), "nothing to abort in a room that succeeded"
    assert rooms.drained(8)
    assert rooms.drained(99), "a room never sent"


def test_the_frames_are_sglangs_and_its_answers_read_back() -> None:
    reg = ext.sglang_nixl_registration(
        ("127.0.0.1", 5000),
        "agent",
        b"md",
        [1, 2, 3, 4],
        [64] * 4,
        10,
        "DRAM",
        [9],
        gpu_id=0,
        tp=(1, 0),
    )
    assert len(reg) == 25 and reg[0] == b"NixlMsgGuard" and reg[1] == b"None"
    assert reg[6] == struct.pack("4Q", 1, 2, 3, 4)
    assert reg[17] == b"10" and reg[18] == b"DRAM,DRAM,DRAM,DRAM"
    room = ext.sglang_nixl_room(7, ("127.0.0.1", 5000), "agent", [3, 4], 2, 1)
    assert len(room) == 11 and room[5] == struct.pack("<2i", 3, 4) and room[10] == b"0"
    assert ext.sglang_nixl_abort(7, ("127.0.0.1", 5000), 3) == [
        b"ABORT",
        b"7",
        b"127.0.0.1",
        b"5000",
        b"3",
    ]
    status = [b"KV_STATUS", b"7", b"4", b"0", b""]
    assert ext.sglang_nixl_from_prefill(status) == ("status", 7, 4, 0, "")
    ack = [b"ABORT_ACK", b"7", b"1", b"3"]
    assert ext.sglang_nixl_from_prefill(ack) == ("ack", 7, 1, 3)
    with pytest.raises(kvxfer.InvalidArgumentError, match="room"):
        ext.sglang_nixl_from_prefill([b"KV_STATUS", b"-1", b"4", b"0"])


def test_a_dead_prefills_unfinished_rooms_fail_and_give_their_pages_back() -> None:
    rooms = StockRooms(30.0, Clock())
    rooms.sent(1, "p:1", (0,))
    rooms.sent(2, "p:1", (0,))
    rooms.sent(3, "q:2", (0,))
    rooms.on_status(2, SUCCESS, 0, "")
    assert rooms.prefill_died("p:1", "missed 2 heartbeats") == 1
    assert rooms.status(1) == (FAILED, "missed 2 heartbeats")
    assert rooms.drained(1), "a dead prefill writes nothing"
    assert rooms.status(2) == (SUCCESS, None)
    assert rooms.status(3) == (TRANSFERRING, None) and not rooms.drained(3)
