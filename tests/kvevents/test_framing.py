"""ZeroMQ message shapes: live 3-frame messages and both replay generations
(engine-events-and-subscriber.md §2.1)."""

from __future__ import annotations

import pytest

from inferencecache.kvevents.framing import (
    END_SEQ,
    FrameError,
    ReplayData,
    ReplayEnd,
    live_message,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_data,
    replay_end,
    replay_request,
    unpack_seq,
)


def test_live_round_trip_and_seq_is_unsigned_big_endian() -> None:
    frames = live_message(b"kv-events", 2**64 - 2, b"payload")
    assert frames[1] == bytes.fromhex("fffffffffffffffe")
    assert parse_live(frames) == (b"kv-events", 2**64 - 2, b"payload")
    assert pack_seq(1) == bytes.fromhex("0000000000000001") and unpack_seq(pack_seq(7)) == 7


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"", b"\x00" * 8], "frame_count"),
        ([b"", b"\x00" * 8, b"p", b"x"], "frame_count"),
        ([b"p"], "frame_count"),
        ([b"", b"\x00" * 7, b"p"], "seq_length"),
        ([b"", b"\x00" * 9, b"p"], "seq_length"),
    ],
)
def test_s13_17_wrong_frame_count_or_seq_length_is_a_frame_error(
    frames: list[bytes], reason: str
) -> None:
    with pytest.raises(FrameError) as e:
        parse_live(frames)
    assert e.value.reason == reason


def test_replay_request_shapes() -> None:
    assert replay_request(5) == [b"", pack_seq(5)]
    assert parse_replay_request([b"id", b"", pack_seq(5)]) == (b"id", 5)
    assert parse_replay_request([b"id", pack_seq(5)]) is None  # DEALER without the delimiter
    assert parse_replay_request([b"id", b"x", pack_seq(5)]) is None
    assert parse_replay_request([b"id", b"", b"\x05"]) is None


@pytest.mark.parametrize("with_topic", [False, True], ids=["vllm<=0.25", "vllm>=0.26"])
def test_s13_22_both_reply_generations_parse_and_end(with_topic: bool) -> None:
    data = replay_data(b"id", b"kv", 9, b"payload", with_topic)[1:]  # the ROUTER strips the id
    end = replay_end(b"id", with_topic)[1:]
    assert len(data) == (4 if with_topic else 3)
    assert parse_replay_reply(data) == ReplayData(9, b"payload")
    assert parse_replay_reply(end) == ReplayEnd()
    assert end[-2] == END_SEQ.to_bytes(8, "big") and end[-1] == b""


@pytest.mark.parametrize(
    "frames",
    [[], [b"x", pack_seq(1), b"p"], [b"", pack_seq(1)], [b"", b"t", b"t", pack_seq(1), b"p"],
     [b"", b"\x01", b"p"]],
)
def test_other_reply_shapes_are_ignored(frames: list[bytes]) -> None:
    assert parse_replay_reply(frames) is None
