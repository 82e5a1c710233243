"""The index store: random operation sequences on the compiled ``_blockmap.BlockMap`` and on
the pure-Python ``MemStore`` (its optional capabilities through the Protocol's plain defaults,
``store.PartitionOps``) must answer every call alike and hold the same state after.

The input is read as a program: each op is one byte (which operation) followed by the bytes
its arguments take. Keys come from a small pool (8-byte and odd-length keys, so inline and
side-table slots share clusters) or straight from the input; times and counts are narrow so
freshness boundaries and eviction ties are hit often.
"""

from __future__ import annotations

import struct
from typing import Any

from inferencecache import accelerators
from inferencecache.index.memstore import MemStore
from inferencecache.index.store import PartitionOps

_BLOCKMAP: Any = accelerators.built("inferencecache.index._blockmap")

_POOL = [struct.pack("<Q", i) for i in range(10)] + [
    b"", b"\x00", b"\x00" * 7, b"\x00" * 9, bytes(range(40)), struct.pack("<Q", 1)[:4],
]
_BIG_TIER = 2**31 - 1


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def left(self) -> bool:
        return self.pos < len(self.data)

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def i32(self) -> int:
        raw = self.data[self.pos : self.pos + 4].ljust(4, b"\x00")
        self.pos += 4
        return int(struct.unpack("<i", raw)[0])

    def key(self) -> bytes:
        b = self.byte()
        if b < 0xF0:
            return _POOL[b % len(_POOL)]
        n = b - 0xF0  # 0..15 bytes straight from the input
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        return raw

    def keys(self) -> list[bytes]:
        return [self.key() for _ in range(self.byte() % 24)]

    def replica(self) -> int:
        b = self.byte()
        return 2**32 - 2 if b == 0xFF else b % 6

    def time(self) -> int:
        return self.byte() % 22 - 1

    def tier(self) -> int:
        b = self.byte()
        return (1, 2, 3, _BIG_TIER)[b % 4] if b < 0xF0 else 4 + b

    def count(self) -> int:
        b = self.byte()
        return self.i32() if b == 0xFF else b % 70 - 3


def check(data: bytes) -> None:
    if _BLOCKMAP is None:
        return
    native: Any = _BLOCKMAP.BlockMap()
    ref = PartitionOps(MemStore())
    r = _Reader(data)
    if r.byte() & 1:
        native._tune_candidates(1, 1)  # tiny caches: the threshold paths
    steps = 0
    while r.left() and steps < 64:
        steps += 1
        op = r.byte() % 13
        if op == 0:
            args: tuple[Any, ...] = (r.key(), r.replica(), r.count(), r.time(), r.tier())
            assert native.upsert(*args) == ref.upsert(*args)
        elif op == 1:
            keys = r.keys()
            tokens = [r.count() for _ in keys]
            rest = (r.replica(), r.time(), r.tier())
            as_bytes = bool(r.byte() & 1) and all(len(k) == 8 for k in keys)
            got = native.upsert_many(b"".join(keys) if as_bytes else keys, tokens, *rest)
            assert got == ref.upsert_many(keys, tokens, *rest)
        elif op == 2:
            k, rep = r.key(), r.replica()
            assert native.remove_hold(k, rep) == ref.remove_hold(k, rep)
        elif op == 3:
            keys, rep = r.keys(), r.replica()
            assert native.remove_holds(keys, rep) == ref.remove_holds(keys, rep)
        elif op == 4:
            rep = r.replica()
            assert native.remove_replica(rep) == ref.remove_replica(rep)
        elif op == 5:
            k = r.key()
            assert sorted(native.remove_key(k)) == sorted(ref.remove_key(k))
        elif op == 6:
            t = r.time()
            assert native.sweep(t) == ref.sweep(t)
        elif op == 7:
            keys = r.keys()
            blocks, rep = r.byte() % (len(keys) + 1), r.replica()
            native.credit(keys, blocks, rep)
            ref.credit(keys, blocks, rep)
        elif op == 8:
            keys = r.keys()
            counts = [r.count() for _ in keys]
            fresh = r.time()
            assert sorted(native.walk(keys, counts, fresh)) == sorted(ref.walk(keys, counts, fresh))
            if all(len(k) == 8 for k in keys):
                assert sorted(native.walk(b"".join(keys), counts, fresh)) == sorted(
                    ref.walk(keys, counts, fresh))
        elif op == 9:
            k, fresh = r.key(), r.time()
            assert sorted(native.holders(k, fresh)) == sorted(ref.holders(k, fresh))
        elif op == 10:
            n, lfu = r.byte() % 42 - 1, bool(r.byte() & 1)
            assert sorted(native.cap_candidates(n, lfu)) == sorted(ref.cap_candidates(n, lfu))
        elif op == 11:
            n = r.byte() % 32 - 1
            assert sorted(native.quota_candidates(n)) == sorted(ref.quota_candidates(n))
        else:
            stored = sorted({h.key for h in ref.holds()})
            if stored:
                keys = [stored[r.byte() % len(stored)] for _ in range(r.byte() % 30 + 1)]
                counts = [r.count() for _ in keys]
                fresh = r.time()
                assert sorted(native.walk(keys, counts, fresh)) == sorted(
                    ref.walk(keys, counts, fresh))
        assert native.key_count() == ref.key_count()
        assert native.hold_count() == ref.hold_count()
    assert sorted(native.holds()) == sorted(ref.holds())
    if ref.hold_count():
        assert native.replica_summary() == ref.replica_summary()
    native.check_invariants()


def seeds() -> list[bytes]:
    return [
        b"\x00" + bytes([1, 12]) + bytes(range(12)) + b"\x02\x05\x01" + b"\x08\x06" + bytes(6)
        + bytes(6) + b"\x03",
        b"\x01" + b"\x00\x01\x02\x10\x05\x00" * 8 + b"\x06\x09" + b"\x0a\x05\x01",
        b"\x00\x01\x05" + b"\xf8" + b"abcdefgh" + b"\xf3xyz" + b"\x01" * 10 + b"\x04\x01",
    ]
