"""Snapshot files: the index state at one log position, versioned and checksummed
(docs/event-log.md, "Snapshots").

File ``snapshot-<sequence, 20 digits>.icsnap`` in ``--snapshot-dir``:

    header (72 bytes, little-endian):
      8s  magic b"ICSNAP\\r\\n"
      u32 format version (1), u32 section count
      u64 sequence number of the last applied entry, u64 + u64 its stream id (ms, seq)
      i64 log clock µs, i64 last sweep µs, i64 wall-clock µs when written
      u64 XXH3-64 of the 64 bytes above
    sections, each: u32 kind, u32 0, u64 length, u64 XXH3-64 of the payload, payload
      kind 1: index meta (``index.persist`` JSON)   kind 2: one partition's holds (in order)
      kind 3: the policy body in force (absent: the replica's startup policy)

Written to a temporary name, fsynced, renamed, the directory fsynced; the newest two are kept.
A file that fails any check (magic, version, checksums, lengths, section count) is skipped with
one log line and the next older one is tried.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import xxhash

from inferencecache.eventlog.applier import LogTime

log = logging.getLogger("inferencecache.eventlog")

MAGIC: Final = b"ICSNAP\r\n"
VERSION: Final = 1
SEC_META: Final = 1
SEC_HOLDS: Final = 2
SEC_POLICY: Final = 3
KEEP: Final = 2

_HEAD = struct.Struct("<8sIIQQQqqq")
_CHECK = struct.Struct("<Q")
_SEC = struct.Struct("<IIQQ")
_NAME = re.compile(r"^snapshot-(\d{20})\.icsnap$")


class SnapshotError(ValueError):
    """A snapshot file that cannot be used."""


@dataclass(frozen=True, slots=True)
class Position:
    """Where a replica is in the log: the last applied entry's sequence number and stream id."""

    seq: int = 0
    id_ms: int = 0
    id_seq: int = 0

    @property
    def stream_id(self) -> bytes:
        return f"{self.id_ms}-{self.id_seq}".encode()

    @classmethod
    def of(cls, seq: int, stream_id: bytes | str) -> Position:
        text = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
        ms, _, part = text.partition("-")
        return cls(seq, int(ms), int(part or 0))


@dataclass(slots=True)
class Snapshot:
    """A loaded snapshot: position, applier state, the ``index.persist`` blobs."""

    path: str
    position: Position
    time: LogTime
    written_us: int
    blobs: list[bytes]


def _digest(data: bytes | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def encode(position: Position, time_: LogTime, blobs: list[bytes]) -> list[bytes]:
    """The file's bytes, as chunks."""
    sections: list[tuple[int, bytes]] = [(SEC_META, blobs[0])]
    sections += [(SEC_HOLDS, b) for b in blobs[1:]]
    if time_.policy_body is not None:
        sections.append((SEC_POLICY, time_.policy_body))
    head = _HEAD.pack(MAGIC, VERSION, len(sections), position.seq, position.id_ms,
                      position.id_seq, time_.clock_us, time_.last_sweep_us,
                      time.time_ns() // 1000)
    out = [head, _CHECK.pack(_digest(head))]
    for kind, payload in sections:
        out.append(_SEC.pack(kind, 0, len(payload), _digest(payload)))
        out.append(payload)
    return out


def decode(data: bytes, path: str = "") -> Snapshot:
    """Parse and verify a whole file; ``SnapshotError`` on any problem."""
    view = memoryview(data)
    if len(data) < _HEAD.size + _CHECK.size:
        raise SnapshotError("truncated header")
    magic, version, count, seq, id_ms, id_seq, clock, sweep, written = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError("not a snapshot file")
    (check,) = _CHECK.unpack_from(data, _HEAD.size)
    if check != _digest(view[: _HEAD.size]):
        raise SnapshotError("header checksum mismatch")
    if version != VERSION:
        raise SnapshotError(f"snapshot format {version}, this build reads {VERSION}")
    pos = _HEAD.size + _CHECK.size
    blobs: list[bytes] = []
    policy: bytes | None = None
    for i in range(count):
        if pos + _SEC.size > len(data):
            raise SnapshotError(f"truncated at section {i} of {count}")
        kind, _, length, digest = _SEC.unpack_from(data, pos)
        pos += _SEC.size
        if pos + length > len(data):
            raise SnapshotError(f"truncated in section {i} of {count}")
        payload = view[pos : pos + length]
        if _digest(payload) != digest:
            raise SnapshotError(f"checksum mismatch in section {i}")
        pos += length
        if kind == SEC_META:
            if blobs:
                raise SnapshotError("a second meta section")
            blobs.append(bytes(payload))
        elif kind == SEC_HOLDS:
            if not blobs:
                raise SnapshotError("holds before the meta section")
            blobs.append(bytes(payload))
        elif kind == SEC_POLICY:
            policy = bytes(payload)
        else:
            raise SnapshotError(f"unknown section kind {kind}")
    if pos != len(data):
        raise SnapshotError("bytes after the last section")
    if not blobs:
        raise SnapshotError("no meta section")
    return Snapshot(path, Position(seq, id_ms, id_seq), LogTime(clock, sweep, policy), written,
                    blobs)


class SnapshotStore:
    """The snapshot files of one directory."""

    def __init__(self, directory: str, keep: int = KEEP) -> None:
        self.dir = directory
        self.keep = keep
        self.skipped = 0

    def paths(self) -> list[tuple[int, str]]:
        """(sequence, path) of every snapshot file, newest first."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        found = [(int(m.group(1)), os.path.join(self.dir, n))
                 for n in names if (m := _NAME.match(n))]  # fmt: skip
        return sorted(found, reverse=True)

    def write(self, position: Position, time_: LogTime, blobs: list[bytes]) -> tuple[str, int]:
        """Write atomically (temp file, fsync, rename, fsync the directory), then delete all but
        the newest ``keep``. Returns (path, bytes)."""
        os.makedirs(self.dir, exist_ok=True)
        final = os.path.join(self.dir, f"snapshot-{position.seq:020d}.icsnap")
        tmp = os.path.join(self.dir, f".tmp-{os.getpid()}-{position.seq}.icsnap")
        size = 0
        with open(tmp, "wb") as f:
            for chunk in encode(position, time_, blobs):
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for _, old in self.paths()[self.keep :]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
        return final, size

    def discard_after(self, seq: int) -> list[str]:
        """Delete the snapshots of positions beyond ``seq`` (after the log went back, they cover
        entries it no longer has, and their numbers would rank them above every new one)."""
        gone = []
        for n, path in self.paths():
            if n > seq:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                gone.append(path)
        return gone

    def newest_first(self) -> Iterator[Snapshot]:
        """Every valid snapshot, newest first; an invalid one is skipped with one log line."""
        for _, path in self.paths():
            try:
                with open(path, "rb") as f:
                    data = f.read()
                snap = decode(data, path)
            except (OSError, SnapshotError) as e:
                log.warning("snapshot skipped", extra={"path": path, "err": str(e)})
                self.skipped += 1
                continue
            yield snap
