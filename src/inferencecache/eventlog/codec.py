"""The binary format of one log entry (docs/event-log.md, "Entry format").

An entry is a small envelope around items, each item the exact bytes the contract defines
(a ``CacheStateUpdate`` or a ``CacheEvent`` as the server accepted it), so another
implementation reads the log with only the ``.proto`` and this page:

    u8  magic 0x1C, u8 version (1)
    i64 appender wall clock, µs since the Unix epoch, little-endian
    varint length + UTF-8 appender id (host/process; for logs and metrics only)
    varint item count
    per item: u8 kind, varint length, payload

Kinds: 1 ``CacheStateUpdate`` bytes, 2 ``CacheEvent`` bytes, 3 tick (empty: lets a quiet log
advance the log clock so replicas sweep), 4 policy (the ``POST /policy`` JSON body). A reader
skips items of kinds it does not know (counted); an entry of another version is dropped whole.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from inferencecache import varint

MAGIC: Final = 0x1C
VERSION: Final = 1

KIND_UPDATE: Final = 1
KIND_EVENT: Final = 2
KIND_TICK: Final = 3
KIND_POLICY: Final = 4
KINDS: Final = {KIND_UPDATE: "update", KIND_EVENT: "event", KIND_TICK: "tick",
                KIND_POLICY: "policy"}  # fmt: skip

_HEAD = struct.Struct("<BBq")


class EntryError(ValueError):
    """Bytes that are not a readable entry; ``reason`` is a bounded metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Entry:
    """One decoded entry. ``items`` keeps unknown kinds too (the applier counts and skips them)."""

    timestamp_us: int
    appender: str
    items: list[tuple[int, bytes]]


def encode(timestamp_us: int, appender: str, items: Iterable[tuple[int, bytes]]) -> bytes:
    """One entry's bytes."""
    out = bytearray(_HEAD.pack(MAGIC, VERSION, timestamp_us))
    name = appender.encode()
    varint.put(out, len(name))
    out += name
    body = bytearray()
    count = 0
    for kind, payload in items:
        body.append(kind)
        varint.put(body, len(payload))
        body += payload
        count += 1
    varint.put(out, count)
    out += body
    return bytes(out)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise EntryError("truncated", "varint runs past the end")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise EntryError("malformed", "varint longer than 10 bytes")


def decode(buf: bytes) -> Entry:
    """Parse one entry; ``EntryError`` for anything else (never another exception)."""
    if len(buf) < _HEAD.size:
        raise EntryError("truncated", f"{len(buf)} bytes")
    magic, version, ts = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise EntryError("malformed", f"magic {magic:#x}")
    if version != VERSION:
        raise EntryError("version", f"entry format {version}, this reader knows {VERSION}")
    pos = _HEAD.size
    n, pos = _varint(buf, pos)
    if pos + n > len(buf):
        raise EntryError("truncated", "appender id")
    try:
        appender = buf[pos : pos + n].decode()
    except UnicodeDecodeError as e:
        raise EntryError("malformed", "appender id is not UTF-8") from e
    pos += n
    count, pos = _varint(buf, pos)
    items: list[tuple[int, bytes]] = []
    for _ in range(count):
        if pos >= len(buf):
            raise EntryError("truncated", f"{len(items)} of {count} items")
        kind = buf[pos]
        n, pos = _varint(buf, pos + 1)
        if pos + n > len(buf):
            raise EntryError("truncated", f"item {len(items)}")
        items.append((kind, buf[pos : pos + n]))
        pos += n
    if pos != len(buf):
        raise EntryError("malformed", f"{len(buf) - pos} bytes after the last item")
    return Entry(ts, appender, items)
