"""ZeroMQ message shapes of the engines' event publisher (engine-events-and-subscriber.md §2.1).

Live PUB messages are exactly three frames ``topic, seq, payload`` with ``seq`` an 8-byte
unsigned big-endian counter. Replay runs over ROUTER (engine) / DEALER (client): the request is
``["", start_seq]`` from a DEALER (``[identity, "", start_seq]`` as the ROUTER sees it); replies
come in two generations, without a topic frame (vLLM ≤ 0.25, SGLang ≤ 0.5.21) and with one
(vLLM ≥ 0.26, SGLang ≥ 0.5.22), each ending with a marker whose seq is ``FFFFFFFFFFFFFFFF``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "END_SEQ",
    "FrameError",
    "ReplayData",
    "ReplayEnd",
    "live_message",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_data",
    "replay_end",
    "replay_request",
    "unpack_seq",
]

END_SEQ: Final = 0xFFFF_FFFF_FFFF_FFFF
_END_FRAME: Final = b"\xff" * 8


class FrameError(ValueError):
    """A live message of the wrong shape; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def pack_seq(seq: int) -> bytes:
    """8-byte unsigned big-endian sequence frame."""
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes) -> int:
    """Inverse of :func:`pack_seq` (the frame must be 8 bytes)."""
    return int.from_bytes(frame, "big")


def live_message(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three frames one PUB message carries."""
    return [topic, pack_seq(seq), payload]


def parse_live(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a live message; :class:`FrameError` for any other shape."""
    if len(frames) != 3:
        raise FrameError("frame_count", f"message of {len(frames)} frames (want 3)")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise FrameError("seq_length", f"seq frame of {len(seq)} bytes (want 8)")
    return topic, int.from_bytes(seq, "big"), payload


# ---- replay ----------------------------------------------------------------------------------


def replay_request(start_seq: int) -> list[bytes]:
    """Frames a DEALER sends to ask for every buffered batch with seq ≥ ``start_seq``."""
    return [b"", pack_seq(start_seq)]


def parse_replay_request(frames: list[bytes]) -> tuple[bytes, int] | None:
    """ROUTER side: ``(identity, start_seq)`` for exactly ``[identity, "", 8-byte seq]``."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return frames[0], int.from_bytes(frames[2], "big")


def replay_data(
    identity: bytes, topic: bytes, seq: int, payload: bytes, with_topic: bool
) -> list[bytes]:
    """ROUTER frames of one replayed batch, in the chosen generation's shape."""
    if with_topic:
        return [identity, b"", topic, pack_seq(seq), payload]
    return [identity, b"", pack_seq(seq), payload]


def replay_end(identity: bytes, with_topic: bool) -> list[bytes]:
    """ROUTER frames of the end marker."""
    if with_topic:
        return [identity, b"", b"", _END_FRAME, b""]
    return [identity, b"", _END_FRAME, b""]


@dataclass(frozen=True, slots=True)
class ReplayData:
    """One replayed batch."""

    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReplayEnd:
    """The end of a replay answer."""


def parse_replay_reply(frames: list[bytes]) -> ReplayData | ReplayEnd | None:
    """DEALER side, both generations: drop the empty delimiter; 3 frames = topic, seq, payload;
    2 = seq, payload; seq ``FFFFFFFFFFFFFFFF`` is the end marker; anything else is ``None``."""
    if not frames or frames[0] != b"":
        return None
    rest = frames[1:]
    if len(rest) == 3:
        rest = rest[1:]
    elif len(rest) != 2:
        return None
    seq, payload = rest
    if len(seq) != 8:
        return None
    if seq == _END_FRAME:
        return ReplayEnd()
    return ReplayData(int.from_bytes(seq, "big"), payload)
