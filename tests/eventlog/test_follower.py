"""Appender and follower against a real redis-server: group commit, sequence numbers, a trimmed
gap detected and recovered, the log going back, Redis down and back (docs/event-log.md)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import redis

from inferencecache.eventlog import EventLogConfig, EventLogMetrics, LogNode, LogUnavailable, codec
from inferencecache.index import Index, IndexSettings, LookupRequest, Router
from inferencecache.procs import RedisServer
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

pytestmark = pytest.mark.timeout(120)


def update(replica: str, first: int, n: int) -> bytes:
    return bytes(pb.CacheStateUpdate(
        replica_id=replica, model_id="m", tenant_id="t", hash_scheme="s",
        prefixes=[pb.PrefixEntry(prefix_hash=(first + i).to_bytes(8, "big"), token_count=16)
                  for i in range(n)]).SerializeToString())


def node(url: str, tmp_path=None, read_only: bool = False, **kw) -> tuple[LogNode, Index]:
    idx = Index(IndexSettings())
    cfg = EventLogConfig(url, snapshot_dir=str(tmp_path) if tmp_path else "", **kw)
    n = LogNode(idx, cfg, EventLogMetrics(), read_only=read_only)
    n.start()
    return n, idx


def metric(n: LogNode, name: str, **labels: str) -> float:
    for fam in n.metrics.registry.collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def holds(idx: Index) -> set[tuple[bytes, str]]:
    return {(h.key, h.replica_id) for h in idx.holds()}


def test_group_commit_and_sequence_numbers(redis_server: RedisServer) -> None:
    a, idx = node(redis_server.url)
    try:
        futs = [a.submit(codec.KIND_UPDATE, update(f"r{i % 3}", i * 10, 10)) for i in range(200)]
        for f in futs:
            f.result(10)
        r = redis.Redis.from_url(redis_server.url)
        seq = int(r.get("{inferencecache}:seq") or 0)
        entries: Any = r.xrange("{inferencecache}:log")
        assert [int(f[b"n"]) for _, f in entries] == list(range(1, seq + 1))
        assert sum(len(codec.decode(f[b"d"]).items) for _, f in entries) == 200
        assert a.follower.wait_for(seq, 10)
        assert len(holds(idx)) == 2000
        assert metric(a, "inferencecache_eventlog_applied_entries_total") == seq
    finally:
        a.stop()


def test_trimmed_gap_is_counted_and_recovered(redis_server: RedisServer, tmp_path) -> None:
    a, _ = node(redis_server.url)
    b, _idx_b = node(redis_server.url, tmp_path / "b", read_only=True)
    try:
        a.submit(codec.KIND_UPDATE, update("r0", 0, 50)).result(10)
        assert b.follower.wait_for(1, 10)
        assert b.follower.snapshot_now() is not None
        b.stop()
        # while b is down: more entries, then everything older than "now" is trimmed
        a.submit(codec.KIND_UPDATE, update("r1", 100, 50)).result(10)
        a.submit(codec.KIND_EVENT, pb.CacheEvent(
            type=pb.CacheEvent.PREFIX_EVICTED, replica_id="r0", model_id="m", tenant_id="t",
            prefix_hash=(0).to_bytes(8, "big")).SerializeToString()).result(10)
        time.sleep(0.01)
        assert a.appender is not None and a.appender.trim(0) == 3
        a.submit(codec.KIND_UPDATE, update("r2", 200, 50)).result(10)  # entry 4: kept
        b2, idx_b2 = node(redis_server.url, tmp_path / "b", read_only=True)
        try:
            assert b2.follower.wait_for(4, 10)
            assert metric(b2, "inferencecache_eventlog_gaps_total", reason="trimmed") == 1
            assert metric(b2, "inferencecache_eventlog_recoveries_total", source="replay") == 1
            # rebuilt from what the log still has: only entry 4
            assert {r for _, r in holds(idx_b2)} == {"r2"}
            assert idx_b2.verify() == []
        finally:
            b2.stop()
    finally:
        a.stop()


def test_redis_down_fails_fast_serves_from_memory_and_resumes(tmp_path) -> None:
    d = tmp_path / "redis"
    d.mkdir()
    srv = RedisServer(str(d)).start()
    a, idx = node(srv.url)
    b, idx_b = node(srv.url, read_only=True)
    try:
        a.submit(codec.KIND_UPDATE, update("r0", 0, 64)).result(10)
        assert b.follower.wait_for(1, 10)
        req = LookupRequest(tenant_id="t", model_id="m", hash_scheme="s",
                            block_hashes=b"".join(i.to_bytes(8, "big") for i in range(64)),
                            packed_hashes=True, block_token_counts=[16] * 64)
        before = Router(idx_b).lookup(req)
        assert before.reason_code == "PREFIX_MATCH"
        srv.stop()
        with pytest.raises(LogUnavailable):  # the append that finds Redis gone
            a.submit(codec.KIND_UPDATE, update("r1", 0, 8)).result(10)
        t0 = time.monotonic()
        with pytest.raises(LogUnavailable):  # and then at once, without a round trip
            a.submit(codec.KIND_UPDATE, update("r1", 0, 8))
        assert time.monotonic() - t0 < 0.5
        during = Router(idx_b).lookup(req)  # from memory (scores age with the wall clock)
        assert [(r.replica_id, r.matched_tokens) for r in during.replica_scores] == [
            (r.replica_id, r.matched_tokens) for r in before.replica_scores]
        srv.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                a.submit(codec.KIND_UPDATE, update("r1", 0, 8)).result(10)
                break
            except LogUnavailable:
                assert time.monotonic() < deadline, "the appender never came back"
                time.sleep(0.2)
        assert b.follower.wait_for(2, 20) and a.follower.wait_for(2, 20)
        assert holds(idx) == holds(idx_b)
        assert ("r1" in {r for _, r in holds(idx_b)})
        assert metric(b, "inferencecache_eventlog_applied_entries_total") == 2  # none twice
    finally:
        a.stop()
        b.stop()
        srv.stop()


def test_log_that_went_back_is_detected(tmp_path) -> None:
    d = tmp_path / "redis"
    d.mkdir()
    srv = RedisServer(str(d), appendonly=False).start()
    a, idx = node(srv.url, tmp_path / "snaps")
    try:
        for i in range(3):
            a.submit(codec.KIND_UPDATE, update("r0", i * 10, 10)).result(10)
        assert a.follower.wait_for(3, 10)
        stale = a.follower.snapshot_now()
        assert stale is not None
        srv.restart()  # comes back empty: entries 1-3 are gone
        deadline = time.monotonic() + 20
        while True:
            try:
                a.submit(codec.KIND_UPDATE, update("r9", 500, 4)).result(10)
                break
            except LogUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        deadline = time.monotonic() + 20
        while {r for _, r in holds(idx)} != {"r9"}:
            assert time.monotonic() < deadline, holds(idx)
            time.sleep(0.05)
        assert metric(a, "inferencecache_eventlog_gaps_total", reason="rewound") >= 1
        assert not os.path.exists(stale)  # it covered entries the log no longer has
    finally:
        a.stop()
        srv.stop()


def test_password_from_the_config_and_a_wrong_one_is_unavailable(tmp_path) -> None:
    d = tmp_path / "redis"
    d.mkdir()
    with RedisServer(str(d), password="s3cret") as srv:
        good, idx = node(srv.url, password="s3cret")
        try:
            good.submit(codec.KIND_UPDATE, update("r0", 0, 4)).result(10)
            assert good.follower.wait_for(1, 10)
            assert len(holds(idx)) == 4
        finally:
            good.stop()
        bad, _ = node(srv.url)
        try:
            with pytest.raises(LogUnavailable):
                bad.submit(codec.KIND_UPDATE, update("r0", 0, 4)).result(10)
            assert metric(bad, "inferencecache_eventlog_append_errors_total") == 1
        finally:
            bad.stop()


def test_ready_only_once_caught_up_to_within_the_lag(redis_server: RedisServer) -> None:
    """``/readyz``'s rule: not ready while entries are pending and the newest applied one is
    older than ``max_lag``; ready once caught up."""
    from inferencecache.eventlog.follower import Follower
    from inferencecache.eventlog.redislog import RedisLog

    a, _ = node(redis_server.url)
    try:
        futs = [a.submit(codec.KIND_UPDATE, update("r0", i * 4, 4)) for i in range(5)]
        for f in futs:
            f.result(10)
        time.sleep(0.05)
        for i in range(5):  # one entry each (the previous append is done)
            a.submit(codec.KIND_UPDATE, update("r1", i * 4, 4)).result(10)
    finally:
        a.stop()
    r = redis.Redis.from_url(redis_server.url)
    head = int(r.get("{inferencecache}:seq") or 0)
    assert head >= 6
    time.sleep(0.3)  # every entry is now older than max_lag
    m = EventLogMetrics()
    fol = Follower(Index(IndexSettings()), RedisLog(redis_server.url), m, max_lag=0.2,
                   read_count=1, block_ms=10)
    fol._read_once()
    assert fol.position.seq == 1 and not fol.ready
    assert fol.lag()[0] == head - 1 and fol.lag()[1] > 0.2
    while fol.position.seq < head:
        fol._read_once()
        assert fol.ready == (fol.position.seq == head)
    fol._read_once()  # nothing new: still ready
    assert fol.ready and fol.lag() == (0, 0.0)
    assert metric_of(m, "inferencecache_eventlog_replica_ready") == 1


def metric_of(m: EventLogMetrics, name: str) -> float:
    for fam in m.registry.collect():
        for s in fam.samples:
            if s.name == name:
                return float(s.value)
    return 0.0


def test_a_bad_entry_is_dropped_counted_and_the_loop_goes_on(redis_server: RedisServer) -> None:
    """Entries a foreign or broken writer put in the stream (garbage bytes, another version, no
    sequence field) are skipped and counted; the entries around them apply."""
    a, idx = node(redis_server.url)
    try:
        a.submit(codec.KIND_UPDATE, update("r0", 0, 4)).result(10)
        r = redis.Redis.from_url(redis_server.url)
        for data in (b"\x1c\x01garbage", b"\x1c\x09" + bytes(8) + b"\x00\x00"):
            n = r.incr("{inferencecache}:seq")
            r.xadd("{inferencecache}:log", {"n": n, "d": data})
        r.xadd("{inferencecache}:log", {"x": b"no sequence number"})
        r.xadd("{inferencecache}:log", {"n": 1, "d": b"an old number again"})
        r.xadd("{inferencecache}:log", {"n": -3, "d": b"a bad number"})
        a.submit(codec.KIND_UPDATE, update("r1", 0, 4)).result(10)
        seq = int(r.get("{inferencecache}:seq") or 0)
        assert a.follower.wait_for(seq, 10)
        assert {rep for _, rep in holds(idx)} == {"r0", "r1"}
        assert metric(a, "inferencecache_eventlog_dropped_total", reason="entry_truncated") == 1
        assert metric(a, "inferencecache_eventlog_dropped_total", reason="entry_version") == 1
        assert metric(a, "inferencecache_eventlog_dropped_total",
                      reason="entry_no_sequence") == 2
        assert metric(a, "inferencecache_eventlog_dropped_total",
                      reason="entry_out_of_order") == 1
        assert metric(a, "inferencecache_eventlog_gaps_total", reason="trimmed") == 0
        assert metric(a, "inferencecache_eventlog_gaps_total", reason="rewound") == 0
        assert idx.verify() == []
    finally:
        a.stop()


def test_replicas_with_other_index_settings_are_flagged(redis_server: RedisServer) -> None:
    """Every replica compares its index settings with those the last appending replica
    published: a replica with another TTL would not hold the same state."""
    cfg = EventLogConfig(redis_server.url)
    a = LogNode(Index(IndexSettings(default_ttl=600.0)), cfg, EventLogMetrics())
    same = LogNode(Index(IndexSettings(default_ttl=600.0)), cfg, EventLogMetrics(),
                   read_only=True)
    other = LogNode(Index(IndexSettings()), cfg, EventLogMetrics(), read_only=True)
    try:
        a.start()
        a.submit(codec.KIND_TICK, b"").result(10)
        assert a.follower.wait_for(1, 10)
        for n in (same, other):
            n.start()
            assert n.follower.wait_for(1, 10)
        deadline = time.monotonic() + 10
        while metric(other, "inferencecache_eventlog_settings_mismatch") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert metric(same, "inferencecache_eventlog_settings_mismatch") == 0
        assert metric(a, "inferencecache_eventlog_settings_mismatch") == 0
    finally:
        for n in (a, same, other):
            n.stop()


def test_c13_1_log_applied_changes_reach_the_change_feed(redis_server: RedisServer) -> None:
    """A replica applying the log reports each applied change to its observers
    (contract-and-index.md §13.1), in log order; a snapshot-style state replacement cuts them
    off (contract-and-index.md §13.3)."""
    from inferencecache.index.changes import PREFIX_ADDED, Replaced

    a, _ = node(redis_server.url)
    b, idx_b = node(redis_server.url)
    obs = idx_b.observe()
    try:
        futs = [a.submit(codec.KIND_UPDATE, update(f"r{i}", i * 10, 3)) for i in range(4)]
        for f in futs:
            f.result(10)
        r = redis.Redis.from_url(redis_server.url)
        assert b.follower.wait_for(int(r.get("{inferencecache}:seq") or 0), 10)
        got = []
        while batch := obs.next_batch(0):
            got += [(c.type, c.replica, list(c.each_hash())) for c in batch]
        assert got == [
            (PREFIX_ADDED, f"r{i}", [(i * 10 + j).to_bytes(8, "big") for j in range(3)])
            for i in range(4)
        ]
        idx_b.replace_state(None)
        with pytest.raises(Replaced):
            obs.next_batch(0)
    finally:
        a.stop()
        b.stop()
