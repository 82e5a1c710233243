"""ICB1 batches (``index/batch.py``): the compiled applier against the reference, the reference
against the messages a batch stands for, and the server's packers against protobuf."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache import updatewire
from inferencecache.index import batch
from inferencecache.index.backends import STORE_BACKENDS
from inferencecache.index.clock import FakeClock
from inferencecache.index.facade import Index
from inferencecache.index.model import PROBE_TENANT, Event, EventType, LegacyRun, PackedUpdate
from inferencecache.index.model import Stats as IStats
from inferencecache.index.settings import IndexSettings
from inferencecache.index.tenant_config import IndexConfig, TenantQuota
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

SMALL = IndexSettings(max_entries_per_update=12, max_holds=40)
NOHASH = IndexSettings(max_hash_bytes=4)
NATIVE = "native" in STORE_BACKENDS

TENANTS = st.sampled_from(["t", "t", "u", PROBE_TENANT])
MODELS = st.sampled_from(["m", "m", "m2"])
SCHEMES = st.sampled_from(["vllm", "vllm", "sgl"])
ADAPTERS = st.sampled_from(["", "", "lora"])
REPLICAS = st.sampled_from(["r0", "r1", "r2", "r3"])
HASHES = st.lists(st.integers(0, 30).map(lambda i: i.to_bytes(8, "big")), min_size=0,
                  max_size=20).map(b"".join)


@st.composite
def records(draw: st.DrawFn) -> batch.Record:
    kind = draw(st.sampled_from([batch.STORE] * 5 + [batch.REMOVE] * 3 +
                                [batch.CLEAR, batch.STATS]))
    route = batch.Route(draw(TENANTS), draw(MODELS), draw(SCHEMES), draw(ADAPTERS),
                        draw(REPLICAS))
    ts = draw(st.sampled_from([0, 0, 1_700_000_000_000_000, 5]))
    if kind == batch.STORE:
        hashes = draw(HASHES)
        tokens = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=len(hashes) // 8,
                               max_size=len(hashes) // 8))
        tier = draw(st.sampled_from([0, 1, 2, 3, 7, -1]))
        return batch.Record(kind, route, ts, tier, hashes, tokens)
    if kind == batch.REMOVE:
        return batch.Record(kind, route, ts, hashes=draw(HASHES))
    if kind == batch.STATS:
        return batch.Record(kind, route, ts, stats=IStats(7, 0.5, 0.25, 3, 4))
    return batch.Record(kind, route, ts)


def _index(store: str, s: IndexSettings, quota: bool) -> Index:
    config = IndexConfig(quotas={"t": TenantQuota(15)}) if quota else IndexConfig()
    return Index(s, clock=FakeClock(), store_factory=STORE_BACKENDS[store], config=config)


def _state(index: Index) -> dict[str, Any]:
    return {"holds": sorted(index.holds()), "stats": sorted(index.stats_rows()),
            "counts": index.counts(), "verify": index.verify()}


def _reference(st_: Any, data: bytes, now: int) -> None:
    try:
        batch.apply_reference(st_, data, now)
    finally:
        st_.finish()  # what the facade does after every mutation


def _as_messages(index: Index, rec: batch.Record, appended: int) -> None:
    """What a record stands for, as the index's update and event objects."""
    r = rec.route
    ts = rec.timestamp_us or appended
    if rec.kind in (batch.STORE, batch.STATS):
        entries = ([LegacyRun(rec.hashes, list(rec.tokens), rec.tier)]
                   if rec.kind == batch.STORE else [])
        index.apply_update(PackedUpdate(r.replica, r.model, r.tenant, r.scheme, ts, entries,
                                        rec.stats, r.adapter))
    elif rec.kind == batch.REMOVE:
        h = rec.hashes
        if h:
            index.apply_event(Event(int(EventType.PREFIX_EVICTED), r.replica, r.model, r.tenant,
                                    h[:8], ts, r.adapter,
                                    [h[i : i + 8] for i in range(8, len(h), 8)]))
    else:
        index.apply_event(Event(int(EventType.ALL_CLEARED), r.replica, r.model, r.tenant))


@pytest.mark.parametrize("store", sorted(STORE_BACKENDS))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(records(), min_size=0, max_size=8), min_size=1, max_size=6),
       which=st.sampled_from(["default", "small", "nohash"]), quota=st.booleans(),
       appended=st.sampled_from([0, 1_650_000_000_000_000]))
def test_batches_apply_as_the_messages_they_stand_for(
    store: str, batches: list[list[batch.Record]], which: str, quota: bool, appended: int
) -> None:
    """Three indexes, the same batches: ``Index.apply_batch`` (compiled for the native store),
    the reference ``batch.apply_reference``, and one update or event per record through
    ``apply_update`` / ``apply_event``: the same holds, stats, counts and views."""
    s = {"default": IndexSettings(), "small": SMALL, "nohash": NOHASH}[which]
    fast, ref, msgs = (_index(store, s, quota) for _ in range(3))
    for recs in batches:
        data = batch.encode(recs, appended)
        def flat(rs: list[batch.Record]) -> list[tuple[Any, ...]]:
            return [(r.kind, r.route, r.timestamp_us, r.tier, r.hashes, list(r.tokens), r.stats)
                    for r in rs]

        assert flat(list(batch.records(data))) == flat(recs)
        fast.apply_batch(data)
        ref.run_locked(_reference, data, ref.clock.now_us())
        for rec in recs:
            _as_messages(msgs, rec, appended or msgs.clock.now_us())
        for ix in (fast, ref, msgs):
            ix.clock.advance(1.0)  # type: ignore[attr-defined]
    want = _state(msgs)
    assert want["verify"] == []
    assert _state(fast) == want
    assert _state(ref) == want


def test_malformed_batches_are_rejected_after_the_good_records() -> None:
    index = _index("native" if NATIVE else "python", IndexSettings(), False)
    good = batch.encode_record(batch.Record(batch.STORE, batch.Route("t", "m", "s", "", "r"),
                                            0, 1, b"\x01" * 8, [16]))
    with pytest.raises(batch.BatchError):
        index.apply_batch(b"XXXX" + bytes(8))
    with pytest.raises(batch.BatchError):
        index.apply_batch(batch.encode([]) + good + b"\x09\x00\x00\x00\x00\x00\x00\x00")
    assert index.counts()["holds"] == 1  # the record before the bad one stays applied
    assert index.verify() == []


needs_packers = pytest.mark.skipif(updatewire.pack_update is None,
                                   reason="the compiled updatewire is not built (pure Python)")


@needs_packers
def test_pack_update_and_event_match_protobuf() -> None:
    """The server's packers read what protobuf reads: random legacy updates and evictions."""
    assert updatewire.pack_update is not None and updatewire.pack_event is not None
    rnd = random.Random(5)
    for _ in range(500):
        n = rnd.randrange(0, 6)
        tier, adapter = rnd.choice([0, 1, 2]), rnd.choice(["", "a"])
        u = pb.CacheStateUpdate(replica_id=rnd.choice(["r", "é"]), model_id="m",
                                tenant_id="t", hash_scheme=rnd.choice(["vllm", ""]),
                                timestamp_us=rnd.choice([0, 99]),
                                adapter_id=rnd.choice(["", "top"]))
        for i in range(n):
            u.prefixes.add(prefix_hash=rnd.randbytes(8), token_count=16 * (i + 1),
                           tier=tier, adapter_id=adapter)  # type: ignore[arg-type]
        if rnd.random() < 0.3:
            u.stats.cache_memory_bytes = rnd.randrange(1000)
            u.stats.hit_rate = 0.5
        got = updatewire.pack_update(u.SerializeToString())
        if n and not u.hash_scheme:
            assert got is None  # dropped entries are counted by the other path
            continue
        assert got is not None
        recs = list(batch.records(got))
        if n:
            r = recs.pop(0)
            assert r.kind == batch.STORE and r.timestamp_us == u.timestamp_us
            assert r.route == batch.Route("t", "m", u.hash_scheme, adapter or u.adapter_id,
                                          u.replica_id)
            assert r.hashes == b"".join(p.prefix_hash for p in u.prefixes)
            assert list(r.tokens) == [p.token_count for p in u.prefixes] and r.tier == tier
        if u.HasField("stats"):
            (r,) = recs
            assert r.kind == batch.STATS and r.stats is not None
            assert r.stats.cache_memory_bytes == u.stats.cache_memory_bytes
        else:
            assert recs == []
    # two runs, a chain entry, a 16-byte hash: parse_update's path
    two = pb.CacheStateUpdate(prefixes=[
        pb.PrefixEntry(prefix_hash=b"\x01" * 8, tier=pb.CACHE_TIER_T1),
        pb.PrefixEntry(prefix_hash=b"\x02" * 8, tier=pb.CACHE_TIER_T2)])
    assert updatewire.pack_update(two.SerializeToString()) is None
    chain = pb.CacheStateUpdate(prefixes=[pb.PrefixEntry(block_hashes=[b"\x01" * 8],
                                                         block_token_counts=[16])])
    assert updatewire.pack_update(chain.SerializeToString()) is None
    assert updatewire.pack_update(b"\xff\xff") is None
    ev = pb.CacheEvent(type=pb.CacheEvent.PREFIX_EVICTED, replica_id="r", model_id="m",
                       tenant_id="t", adapter_id="a", prefix_hash=b"\x01" * 8,
                       prefix_hashes=[b"\x02" * 8, b"\x03" * 8])
    (r,) = batch.records(updatewire.pack_event(ev.SerializeToString()) or b"")
    assert r.kind == batch.REMOVE and r.route == batch.Route("t", "m", "", "a", "r")
    assert r.hashes == b"\x01" * 8 + b"\x02" * 8 + b"\x03" * 8
    for other in (pb.CacheEvent(type=pb.CacheEvent.ALL_CLEARED),
                  pb.CacheEvent(type=pb.CacheEvent.PREFIX_EVICTED, prefix_hash=b"\x01" * 9)):
        assert updatewire.pack_event(other.SerializeToString()) is None
