"""The entry format (docs/event-log.md, "Entry format"): round trip, and every damaged entry is
an ``EntryError`` with a bounded reason, never another exception."""

from __future__ import annotations

import contextlib
import random

import pytest

from inferencecache.eventlog import codec


def test_round_trip_keeps_every_item_and_order() -> None:
    items = [(codec.KIND_UPDATE, b"\x0a\x01r"), (codec.KIND_EVENT, b""), (codec.KIND_TICK, b""),
             (codec.KIND_POLICY, b'{"version":7}'), (99, b"future")]
    raw = codec.encode(1_700_000_000_123_456, "host/42", items)
    entry = codec.decode(raw)
    assert entry.timestamp_us == 1_700_000_000_123_456
    assert entry.appender == "host/42"
    assert entry.items == items


def test_every_truncation_is_an_entry_error() -> None:
    raw = codec.encode(5, "a", [(codec.KIND_UPDATE, bytes(range(200)))])
    for cut in range(len(raw)):
        with pytest.raises(codec.EntryError) as e:
            codec.decode(raw[:cut])
        assert e.value.reason in ("truncated", "malformed")


def test_other_version_and_magic_and_trailing_bytes() -> None:
    raw = bytearray(codec.encode(5, "a", []))
    raw[1] = 2
    with pytest.raises(codec.EntryError) as e:
        codec.decode(bytes(raw))
    assert e.value.reason == "version"
    with pytest.raises(codec.EntryError):
        codec.decode(b"\x00" + bytes(raw[1:]))
    with pytest.raises(codec.EntryError):
        codec.decode(codec.encode(5, "a", []) + b"x")


def test_random_garbage_never_raises_anything_else() -> None:
    rng = random.Random(1337)
    good = codec.encode(7, "x", [(1, b"abc"), (2, b"defg")])
    for _ in range(3000):
        buf = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        with contextlib.suppress(codec.EntryError):
            codec.decode(bytes(buf))
