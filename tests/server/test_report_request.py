"""ReportCacheState's compact parser (``server.report_request`` over ``updatewire``) against
protobuf.

Differential: random updates go through both paths — the compact ``PackedUpdate`` of the
compiled parser and protobuf's ``CacheStateUpdate`` through the generic path — into two indexes,
which must end in the same state (every hold with all its fields, stats rows, drop counters,
metrics, views). The compiled parser reads every field as protobuf does, and the set of decodable
messages is exactly protobuf's (tests/server/test_wire_differential.py has the targeted cases).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache import accelerators, updatewire
from inferencecache.index import (
    PROBE_TENANT,
    STORE_BACKENDS,
    FakeClock,
    Index,
    IndexConfig,
    IndexSettings,
    LegacyRun,
    PackedUpdate,
    RecordingMetrics,
    TenantQuota,
    Update,
)
from inferencecache.server import lookup_wire
from inferencecache.server.report_request import (
    packed_from_parsed,
    parse_slow,
    parse_update_request,
    update_from_message,
)
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

NATIVE: Any = accelerators.built("inferencecache.updatewire._native")
needs_native = pytest.mark.skipif(NATIVE is None, reason="C accelerator not built")
ENCODERS: dict[str, Any] = {"protobuf": updatewire._encode_entries_pb}
if NATIVE is not None:
    ENCODERS["native"] = NATIVE.encode_entries

SMALL = IndexSettings(max_entries_per_update=40, max_blocks_per_entry=6, max_hash_bytes=12,
                      max_holds=60)


# ---- generators --------------------------------------------------------------------------------

HASH8 = st.integers(0, 40).map(lambda i: i.to_bytes(8, "big"))
ODD_HASH = st.sampled_from([b"", b"abc", b"x" * 12, b"y" * 13, b"z" * 7, b"w" * 9])
INT32 = st.one_of(st.sampled_from([0, 16, 32, 48, 4096, -1, 2**31 - 1, -(2**31)]),
                  st.integers(-(2**31), 2**31 - 1))
TIER = st.sampled_from([0, 1, 2, 3, 7, -1, 2**31 - 1, -(2**31)])
ADAPTER = st.sampled_from(["", "", "", "a", "b", "é-lora"])
TEXT = st.sampled_from(["", "r0", "r1", "t", "m", "vllm", "sglang", "ü", PROBE_TENANT])


@st.composite
def prefix_entries(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(["legacy", "legacy", "legacy", "odd", "chain", "chain_bad"]))
    e: dict[str, Any] = {"tier": draw(TIER), "adapter_id": draw(ADAPTER)}
    if kind == "legacy":
        e.update(prefix_hash=draw(HASH8), token_count=draw(INT32))
    elif kind == "odd":
        e.update(prefix_hash=draw(ODD_HASH), token_count=draw(INT32))
    else:
        n = draw(st.integers(1, 8))
        hashes = draw(st.lists(st.one_of(HASH8, ODD_HASH), min_size=n, max_size=n))
        counts = draw(st.lists(INT32, min_size=n, max_size=n))
        if kind == "chain_bad":
            counts = counts[: draw(st.integers(0, n - 1))]
        e.update(block_hashes=hashes, block_token_counts=counts,
                 prefix_hash=draw(st.one_of(st.just(b""), HASH8, ODD_HASH)),
                 token_count=draw(INT32))
    return e


@st.composite
def updates(draw: Any) -> pb.CacheStateUpdate:
    u = pb.CacheStateUpdate(
        replica_id=draw(st.sampled_from(["r0", "r1", "r2", ""])),
        model_id=draw(st.sampled_from(["m", "m2"])),
        tenant_id=draw(st.sampled_from(["t", "t", "u", PROBE_TENANT])),
        hash_scheme=draw(st.sampled_from(["vllm", "vllm", "sglang", ""])),
        timestamp_us=draw(st.sampled_from([0, 0, 1_000, 5_000_000, -7, 2**62])),
        adapter_id=draw(ADAPTER),
    )
    for e in draw(st.lists(prefix_entries(), max_size=60)):
        u.prefixes.add(**e)
    if draw(st.integers(0, 9)) == 0:
        u.stats.hit_rate = draw(st.sampled_from([0.5, float("nan"), 2.0]))
        u.stats.cache_memory_bytes = 7
    return u


def _serialize(u: pb.CacheStateUpdate, rng: random.Random) -> bytes:
    """The message, sometimes with legal variations protobuf must read the same way."""
    buf: bytes = u.SerializeToString()
    r = rng.random()
    if r < 0.15:  # an unknown field (number 30, varint) at the front: skipped
        buf = b"\xf0\x01\x05" + buf
    elif r < 0.25:  # the same update split in two: repeated fields append, scalars last-wins
        half = pb.CacheStateUpdate()
        half.CopyFrom(u)
        del half.prefixes[len(u.prefixes) // 2 :]
        rest = pb.CacheStateUpdate(prefixes=u.prefixes[len(u.prefixes) // 2 :])
        buf = half.SerializeToString() + rest.SerializeToString()
    return buf


# ---- index state -------------------------------------------------------------------------------


def _index(store: str, settings: IndexSettings, quota: bool) -> tuple[Index, RecordingMetrics]:
    metrics = RecordingMetrics()
    config = IndexConfig(quotas={"t": TenantQuota(25)}) if quota else IndexConfig()
    index = Index(settings, clock=FakeClock(), store_factory=STORE_BACKENDS[store],
                  metrics=metrics, config=config)
    return index, metrics


def _state(index: Index, metrics: RecordingMetrics) -> dict[str, Any]:
    holds = sorted(index.holds())
    stats = sorted(index.stats_rows())
    return {
        "holds": holds,
        "stats": stats,
        "counts": index.counts(),
        "verify": index.verify(),
        "dropped": dict(metrics.dropped),
        "entries": dict(metrics.entries),
        "evictions": dict(metrics.evictions),
        "tenant_evicted": dict(metrics.tenant_evicted),
    }


# ---- the differential tests -------------------------------------------------------------------


@pytest.mark.parametrize("store", sorted(STORE_BACKENDS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(updates(), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       small=st.booleans(), quota=st.booleans())
def test_compact_and_protobuf_paths_give_the_same_index(
    store: str, batch: list[pb.CacheStateUpdate], seed: int, small: bool, quota: bool
) -> None:
    rng = random.Random(seed)
    settings_ = SMALL if small else IndexSettings()
    fast, fast_m = _index(store, settings_, quota)
    slow, slow_m = _index(store, settings_, quota)
    for u in batch:
        buf = _serialize(u, rng)
        got = parse_update_request(buf)
        want = parse_slow(buf)
        assert not isinstance(want, type(lookup_wire.UNDECODABLE))
        assert isinstance(got, bytes | PackedUpdate) == (updatewire.parse_update is not None)
        assert isinstance(got, bytes | PackedUpdate | Update) and isinstance(want, Update)
        if isinstance(got, bytes):  # the usual update: an ICB1 batch
            fast.apply_batch(got)
        else:
            fast.apply_update(got)
        slow.apply_update(want)
        for ix in (fast, slow):
            ix.clock.advance(1.0)  # type: ignore[attr-defined]
    assert _state(fast, fast_m) == _state(slow, slow_m)


@needs_native
@settings(max_examples=150, deadline=None)
@given(u=updates(), seed=st.integers(0, 2**16))
def test_parser_agrees_with_protobuf_field_by_field(u: pb.CacheStateUpdate, seed: int) -> None:
    buf = _serialize(u, random.Random(seed))
    parsed = NATIVE.parse_update(buf)
    msg = pb.CacheStateUpdate.FromString(buf)
    assert parsed is not None
    packed = packed_from_parsed(parsed)
    if msg.HasField("stats"):
        s = msg.stats
        want_stats = (s.cache_memory_bytes, s.hit_rate, s.pressure, s.t2_hit_tokens,
                      s.t2_query_tokens)
        assert repr(parsed[7]) == repr(want_stats)  # repr: NaN equals NaN
    else:
        assert parsed[7] is None and packed.stats is None
    assert (packed.replica_id, packed.model_id, packed.tenant_id, packed.hash_scheme,
            packed.timestamp_us, packed.adapter_id) == (
        msg.replica_id, msg.model_id, msg.tenant_id, msg.hash_scheme, msg.timestamp_us,
        msg.adapter_id)
    flat: list[tuple[Any, ...]] = []
    for e in packed.entries:
        if isinstance(e, LegacyRun):
            assert len(e.hashes) == 8 * len(e.token_counts)
            flat += [(e.hashes[8 * i : 8 * i + 8], c, [], [], e.tier, e.adapter_id)
                     for i, c in enumerate(e.token_counts)]
        else:
            flat.append((e.prefix_hash, e.token_count, list(e.block_hashes),
                         list(e.block_token_counts), e.tier, e.adapter_id))
    assert flat == [(p.prefix_hash, p.token_count, list(p.block_hashes),
                     list(p.block_token_counts), p.tier, p.adapter_id) for p in msg.prefixes]
    # consecutive legacy entries of one tier and adapter are one run
    kinds = [(e.tier, e.adapter_id) for e in packed.entries if isinstance(e, LegacyRun)]
    runs = [e for e in packed.entries if isinstance(e, LegacyRun)]
    for a, b in zip(packed.entries, packed.entries[1:], strict=False):
        if isinstance(a, LegacyRun) and isinstance(b, LegacyRun):
            assert (a.tier, a.adapter_id) != (b.tier, b.adapter_id)
    assert len(kinds) == len(runs)


@settings(max_examples=300, deadline=None)
@given(u=updates(), seed=st.integers(0, 2**32))
def test_mutated_bytes_decode_exactly_when_protobuf_decodes(
    u: pb.CacheStateUpdate, seed: int
) -> None:
    """Flipped, cut and inserted bytes: UNDECODABLE iff protobuf rejects, and never a
    different reading of a message protobuf accepts."""
    rng = random.Random(seed)
    buf = bytearray(u.SerializeToString())
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.4 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op < 0.7 and buf:
            del buf[rng.randrange(len(buf)) :]
        else:
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    data = bytes(buf)
    got = parse_update_request(data)
    want = parse_slow(data)
    undecodable = type(lookup_wire.UNDECODABLE)
    assert isinstance(got, undecodable) == isinstance(want, undecodable)
    if isinstance(got, PackedUpdate):
        assert isinstance(want, Update)
        a, am = _index("python", IndexSettings(), False)
        b, bm = _index("python", IndexSettings(), False)
        a.apply_update(got)
        b.apply_update(want)
        assert _state(a, am) == _state(b, bm)


@needs_native
def test_stats_and_unusual_shapes_stay_compiled() -> None:
    u = pb.CacheStateUpdate(replica_id="r", hash_scheme="vllm")
    u.stats.hit_rate = 0.5
    got = packed_from_parsed(NATIVE.parse_update(u.SerializeToString()))
    assert got.stats is not None and got.stats.hit_rate == 0.5
    # a known field with another wire type is an unknown field to protobuf: skipped
    assert NATIVE.parse_update(b"\x08\x01") == ("", "", "", "", 0, "", [], None)
    # invalid UTF-8, a group, a truncated varint: protobuf decides
    for buf in (b"\x0a\x02\xff\xfe", b"\x33\x34", b"\x32\x03\x10\x80\x80"):
        assert NATIVE.parse_update(buf) is None
        assert isinstance(parse_update_request(buf), type(lookup_wire.UNDECODABLE)) == isinstance(
            parse_slow(buf), type(lookup_wire.UNDECODABLE))


@needs_native
def test_a_subscriber_update_is_one_run() -> None:
    u = pb.CacheStateUpdate(replica_id="r", model_id="m", tenant_id="t", hash_scheme="vllm",
                            timestamp_us=5)
    for i in range(4096):
        u.prefixes.add(prefix_hash=i.to_bytes(8, "big"), token_count=16 * (i % 300 + 1), tier=1)
    got = packed_from_parsed(NATIVE.parse_update(u.SerializeToString()))
    assert len(got.entries) == 1
    run = got.entries[0]
    assert isinstance(run, LegacyRun)
    assert run.hashes == b"".join(i.to_bytes(8, "big") for i in range(4096))
    assert list(run.token_counts) == [16 * (i % 300 + 1) for i in range(4096)]


@pytest.mark.parametrize("impl", sorted(ENCODERS))
def test_encode_entries_is_what_protobuf_writes(impl: str) -> None:
    rng = random.Random(5)
    entries = [(rng.randbytes(rng.choice([0, 3, 8, 8, 8, 200])),
                rng.choice([0, 16, 4096, -1, 2**31 - 1, -(2**31)]),
                rng.choice(["", "a", "é-lora"]), rng.choice([0, 1, 2, 3, -1, 2**31 - 1]))
               for _ in range(300)]
    ref = pb.CacheStateUpdate()
    for p, t, a, tier in entries:
        ref.prefixes.add(prefix_hash=p, token_count=t, adapter_id=a, tier=tier)
    assert ENCODERS[impl](entries) == ref.SerializeToString()
    header = updatewire.encode_header("r", "m", "t", "vllm", -3)
    whole = pb.CacheStateUpdate(replica_id="r", model_id="m", tenant_id="t", hash_scheme="vllm",
                                timestamp_us=-3)
    whole.MergeFrom(ref)
    assert header + ENCODERS[impl](entries) == whole.SerializeToString()
    assert updatewire.encode_header("", "", "", "", 0) == b""
    with pytest.raises(TypeError):
        ENCODERS[impl]([("x", 1, "", 1)])
    with pytest.raises(OverflowError):
        ENCODERS[impl]([(b"x", 2**31, "", 1)])


def test_update_from_message_keeps_stats_presence() -> None:
    u = pb.CacheStateUpdate(replica_id="r")
    assert update_from_message(u).stats is None
    u.stats.SetInParent()
    assert update_from_message(u).stats is not None
