"""Snapshots (docs/event-log.md, "Snapshots"): the index state survives dump → file → load
exactly, on both store backends; a corrupt or truncated file is skipped for the older one."""

from __future__ import annotations

import os
import random

import pytest

from inferencecache.eventlog.applier import LogTime
from inferencecache.eventlog.snapshot import Position, SnapshotError, SnapshotStore, decode, encode
from inferencecache.index import STORE_BACKENDS, Index, IndexSettings, Prefix, Stats, Update
from inferencecache.index.backends import store_factory
from inferencecache.index.model import PROBE_TENANT, Event, EventType


def filled(backend: str, seed: int = 7) -> Index:
    rng = random.Random(seed)
    idx = Index(IndexSettings(max_holds=5000), store_factory=store_factory(backend))
    now = 1_700_000_000_000_000
    for i in range(120):
        tenant = f"t{rng.randrange(3)}"
        prefixes: list[Prefix] = []
        for _ in range(rng.randrange(1, 80)):
            n = 8 if rng.random() < 0.9 else rng.choice([0, 3, 16])
            prefixes.append(Prefix(rng.randbytes(n), rng.randrange(-5, 5000),
                                   tier=rng.choice([0, 1, 2, 3, -1]),
                                   adapter_id=rng.choice(["", "", "lora"])))
        idx.apply_update(Update(f"r{rng.randrange(12)}", f"m{rng.randrange(2)}", tenant, "s",
                                rng.choice([0, now - rng.randrange(10**9)]), prefixes,
                                Stats(rng.randrange(10**9), rng.random(), rng.random())
                                if rng.random() < 0.3 else None), now_us=now + i)
        if rng.random() < 0.2:
            idx.apply_event(Event(int(EventType.ALL_CLEARED), f"r{rng.randrange(12)}", "m0",
                                  tenant), now_us=now + i)
    # a probe partition: never part of a snapshot
    idx.apply_update(Update("probe-r", "m", PROBE_TENANT, "s", 0, [Prefix(b"12345678", 16)]),
                     allow_probe=True)
    return idx


def view(idx: Index) -> tuple[list[object], list[object]]:
    holds = sorted((h.partition, h.key, h.replica_id, h.tokens, h.last_seen_us, h.tier)
                   for h in idx.holds() if h.partition[0] != PROBE_TENANT)
    stats = sorted(idx.stats_rows())
    return holds, stats  # type: ignore[return-value]


@pytest.mark.parametrize("backend", sorted(STORE_BACKENDS))
def test_dump_file_load_is_exact(tmp_path, backend: str) -> None:
    src = filled(backend)
    store = SnapshotStore(str(tmp_path))
    t = LogTime(123, 45, b'{"version":7,"policies":[]}')
    store.write(Position.of(9, b"17-3"), t, src.dump_state())
    snap = next(store.newest_first())
    assert snap.position == Position(9, 17, 3) and snap.time == t
    dst = Index(IndexSettings(max_holds=5000), store_factory=store_factory(backend))
    dst.replace_state(snap.blobs)
    assert dst.verify() == []
    assert view(dst) == view(src)
    assert dst.counts()["reserved_holds"] == 0


def test_corrupt_and_truncated_files_are_skipped_for_the_older_one(tmp_path) -> None:
    src = filled("python")
    store = SnapshotStore(str(tmp_path), keep=3)
    for seq in (1, 2, 3):
        store.write(Position(seq, seq, 0), LogTime(), src.dump_state())
    paths = [p for _, p in store.paths()]
    assert len(paths) == 3
    with open(paths[0], "r+b") as f:  # newest: flip one byte in the middle
        f.seek(os.path.getsize(paths[0]) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(paths[1], "r+b") as f:  # second: truncated
        f.truncate(os.path.getsize(paths[1]) - 10)
    found = [s.position.seq for s in store.newest_first()]
    assert found == [1]
    assert store.skipped == 2


def test_keeps_the_newest_two(tmp_path) -> None:
    store = SnapshotStore(str(tmp_path))
    for seq in range(1, 6):
        store.write(Position(seq, seq, 0), LogTime(), filled("python", seq).dump_state())
    assert [s for s, _ in store.paths()] == [5, 4]


def test_every_truncation_of_a_file_is_rejected() -> None:
    data = b"".join(encode(Position(1, 2, 3), LogTime(4, 5, None), filled("python").dump_state()))
    decode(data)
    for cut in range(0, len(data), max(1, len(data) // 300)):
        with pytest.raises(SnapshotError):
            decode(data[:cut])


def test_compiled_dump_columns_equals_the_default() -> None:
    """The compiled store's one-pass copy (taken under the index lock) holds exactly what the
    plain default built on ``holds()`` does."""
    from inferencecache import accelerators
    from inferencecache.index import store

    native = accelerators.built("inferencecache.index._blockmap")
    if native is None:
        pytest.skip("compiled store not built")  # scripts/check requires it: never skipped there
    rng = random.Random(3)
    m = native.BlockMap()
    for _ in range(3000):
        key = rng.randbytes(8) if rng.random() < 0.95 else rng.randbytes(rng.choice([0, 5, 20]))
        for _ in range(rng.randrange(1, 4)):
            m.upsert(key, rng.randrange(40), rng.randrange(-9, 9999), rng.randrange(10**15),
                     rng.choice([1, 2, 3, 2**31 - 1]))

    def rows(cols: store.Columns) -> list[tuple[bytes, int, int, int, int]]:
        keys, reps, toks, tss, tiers, others = cols
        r, t, s, ti = (memoryview(reps).cast("I"), memoryview(toks).cast("i"),
                       memoryview(tss).cast("q"), memoryview(tiers).cast("i"))
        flat = [(keys[8 * i:8 * i + 8], r[i], t[i], s[i], ti[i]) for i in range(len(r))]
        return sorted(flat + list(others))

    assert rows(m.dump_columns()) == rows(store.dump_columns(m))
    assert len(rows(m.dump_columns())) == m.hold_count()


def test_a_replica_starts_from_the_newest_valid_snapshot(tmp_path) -> None:
    """The follower's start-up: the newest file is corrupt, the older one loads (counted, the
    state and position are the older snapshot's)."""
    from inferencecache.eventlog.follower import Follower
    from inferencecache.eventlog.metrics import EventLogMetrics
    from inferencecache.eventlog.redislog import RedisLog

    src = filled("python")
    store = SnapshotStore(str(tmp_path))
    store.write(Position(4, 40, 0), LogTime(7, 6, None), src.dump_state())
    store.write(Position(9, 90, 0), LogTime(8, 6, None), src.dump_state())
    newest = store.paths()[0][1]
    with open(newest, "r+b") as f:
        f.truncate(100)
    m = EventLogMetrics()
    idx = Index(IndexSettings(max_holds=5000), store_factory=store_factory("python"))
    fol = Follower(idx, RedisLog("redis://127.0.0.1:1/0"), m, snapshots=store)
    fol._load_newest_snapshot()  # no Redis needed for this part
    assert fol.position == Position(4, 40, 0)
    assert view(idx) == view(src)
    skipped = [s.value for f in m.registry.collect() for s in f.samples
               if s.name == "inferencecache_eventlog_snapshot_skipped_total"]
    assert skipped == [1.0]
