"""The time rule (docs/event-log.md): replicas whose own clocks differ store the same state
from the same entries — ``last_seen``, stats times, sweeps, cap victims — and a replica restored
from a snapshot continues exactly like one that never stopped."""

from __future__ import annotations

import random
from typing import Any

import pytest

from inferencecache.eventlog import codec
from inferencecache.eventlog.applier import Applier, LogTime
from inferencecache.eventlog.metrics import EventLogMetrics
from inferencecache.index import FakeClock, Index, IndexSettings
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

SETTINGS = IndexSettings(max_holds=300, default_ttl=50.0, sweep_interval=5.0)


def entries(seed: int, n: int = 400) -> list[codec.Entry]:
    rng = random.Random(seed)
    t = 1_700_000_000_000_000
    out = []
    for _ in range(n):
        t += rng.randrange(0, 2_000_000)
        # appenders' clocks differ a little: timestamps are not monotonic in log order
        ts = t + rng.randrange(-300_000, 300_000)
        items: list[tuple[int, bytes]] = []
        for _ in range(rng.randrange(1, 4)):
            r = rng.random()
            replica = f"r{rng.randrange(6)}"
            if r < 0.7:
                u = pb.CacheStateUpdate(
                    replica_id=replica, model_id="m", tenant_id=f"t{rng.randrange(2)}",
                    hash_scheme="s", timestamp_us=rng.choice([0, 0, 0, ts - 10**6]),
                    prefixes=[pb.PrefixEntry(prefix_hash=rng.randrange(60).to_bytes(8, "big"),
                                             token_count=16 * (i + 1))
                              for i in range(rng.randrange(1, 30))])
                if rng.random() < 0.3:
                    u.stats.hit_rate = rng.random()
                items.append((codec.KIND_UPDATE, u.SerializeToString()))
            elif r < 0.9:
                e = pb.CacheEvent(type=pb.CacheEvent.PREFIX_EVICTED, replica_id=replica,
                                  model_id="m", tenant_id=f"t{rng.randrange(2)}",
                                  prefix_hash=rng.randrange(60).to_bytes(8, "big"))
                items.append((codec.KIND_EVENT, e.SerializeToString()))
            elif r < 0.95:
                items.append((codec.KIND_TICK, b""))
            else:
                items.append((codec.KIND_UPDATE, b"\xff\xff not protobuf"))
        out.append(codec.Entry(ts, "a", items))
    return out


def state(idx: Index) -> tuple[object, ...]:
    holds = sorted((h.partition, h.key, h.replica_id, h.tokens, h.last_seen_us, h.tier)
                   for h in idx.holds())
    return tuple(holds), tuple(sorted(idx.stats_rows())), idx.counts()["holds"]


def replica(clock_offset_s: float) -> tuple[Index, Applier]:
    clock = FakeClock()
    clock.advance(clock_offset_s)
    idx = Index(SETTINGS, clock=clock)
    return idx, Applier(idx, EventLogMetrics())


def test_two_replicas_with_different_clocks_store_the_same_state() -> None:
    log = entries(1)
    a, ap_a = replica(0)
    b, ap_b = replica(3600)
    for e in log:
        ap_a.apply(e)
    for e in log:
        ap_b.apply(e)
    assert state(a) == state(b)
    assert a.verify() == [] and b.verify() == []
    assert int(state(a)[2]) > 0  # type: ignore[call-overload]  # something is left after sweeps and the cap


def test_restored_replica_continues_exactly() -> None:
    log = entries(2)
    a, ap_a = replica(0)
    for e in log:
        ap_a.apply(e)
    b, ap_b = replica(99)
    for e in log[:150]:
        ap_b.apply(e)
    blobs = b.dump_state()
    t = LogTime(ap_b.time.clock_us, ap_b.time.last_sweep_us, ap_b.time.policy_body)
    c, ap_c = replica(-50)
    c.replace_state(blobs)
    ap_c.reset(t)
    for e in log[150:]:
        ap_c.apply(e)
    assert state(c) == state(a)


def test_bad_items_are_counted_and_skipped() -> None:
    _idx, ap = replica(0)
    m = ap.metrics
    ap.apply(codec.Entry(1, "a", [(codec.KIND_UPDATE, b"\xff\xff"), (77, b""),
                                   (codec.KIND_POLICY, b"{not json")]))
    dropped = {s.labels["reason"]: s.value
               for f in m.registry.collect() for s in f.samples
               if s.name == "inferencecache_eventlog_dropped_total"}
    assert dropped == {"undecodable_update": 1.0, "unknown_kind": 1.0, "bad_policy": 1.0}


def test_same_prefix_same_answers_exactly_under_one_clock() -> None:
    """Two replicas that applied the same entries answer every LookupRoute identically,
    scores included, when asked at the same instant (one injected clock; applying never reads
    it, the other tests show)."""
    from inferencecache.index import LookupRequest, Router

    log = entries(3, 300)
    at = FakeClock(now_us=log[-1].timestamp_us + 1_000_000)
    a, b = Index(SETTINGS, clock=at), Index(SETTINGS, clock=at)
    ap_a, ap_b = Applier(a, EventLogMetrics()), Applier(b, EventLogMetrics())
    for e in log:
        ap_a.apply(e)
    for e in log:
        ap_b.apply(e)
    ra, rb = Router(a), Router(b)
    rng = random.Random(9)
    matched = 0
    for _ in range(500):
        start = rng.randrange(60)
        chain = b"".join(k.to_bytes(8, "big") for k in range(start, start + rng.randrange(1, 30)))
        req = LookupRequest(tenant_id=f"t{rng.randrange(2)}", model_id="m", hash_scheme="s",
                            block_hashes=chain, packed_hashes=True,
                            block_token_counts=[16] * (len(chain) // 8))
        x, y = ra.lookup(req), rb.lookup(req)
        assert (x.reason_code, x.replica_scores) == (y.reason_code, y.replica_scores)
        matched += x.reason_code == "PREFIX_MATCH"
    assert matched > 50


def test_an_item_whose_apply_raises_is_dropped_and_the_rest_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug below the applier (the index raising) drops that item only: counted in
    ``dropped_inputs_total{loop="apply"}``, the next item applies."""
    idx, ap = replica(0)
    calls = []

    def flaky(real: Any) -> Any:
        def apply(update: object, **kw: object) -> None:
            calls.append(update)
            if len(calls) == 1:
                raise RuntimeError("a bug")
            real(update, **kw)

        return apply

    # the usual update reaches the index as an ICB1 batch; protobuf's path as an Update
    monkeypatch.setattr(idx, "apply_update", flaky(idx.apply_update))
    monkeypatch.setattr(idx, "apply_batch", flaky(idx.apply_batch))
    good = pb.CacheStateUpdate(replica_id="r", model_id="m", tenant_id="t", hash_scheme="s",
                               prefixes=[pb.PrefixEntry(prefix_hash=b"12345678", token_count=16)])
    raw = good.SerializeToString()
    ap.apply(codec.Entry(1, "a", [(codec.KIND_UPDATE, raw), (codec.KIND_UPDATE, raw)]))
    assert idx.counts()["holds"] == 1
    dropped = {(s.labels["loop"], s.labels["reason"]): s.value
               for f in ap.metrics.registry.collect() for s in f.samples
               if s.name == "inferencecache_eventlog_dropped_inputs_total"}
    assert dropped == {("apply", "internal"): 1.0}
