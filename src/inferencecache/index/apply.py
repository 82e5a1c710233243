"""Ingest rules (contract-and-index.md §4): applying one CacheStateUpdate or one CacheEvent to the
state.

Quota and cap enforcement, metric flushing and locking are the facade's job (``Index``); the
functions here only mutate holds, views and stats rows. Consecutive prefix entries that land in
the same partition with the same tier are written with one ``upsert_many`` call (the subscriber
sends one legacy entry per block, so a whole update is usually one call). An update may also
come in the server's compact form (``PackedUpdate``: runs of legacy entries as one packed bytes
of hashes plus their token counts), which goes to the store without a Python step per entry;
both forms give the same state, counters and metrics. A batched ``PREFIX_EVICTED`` (field 8,
``prefix_hashes``) removes all its hashes with one store call per partition.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from itertools import accumulate

from inferencecache.index import bounds
from inferencecache.index.changes import (
    ALL_CLEARED,
    PREFIX_ADDED,
    PREFIX_EVICTED,
    REPLICA_UPDATED,
    Change,
)
from inferencecache.index.eviction import note_upsert
from inferencecache.index.model import (
    PROBE_TENANT,
    EventLike,
    EventType,
    LegacyRun,
    PackedUpdate,
    PrefixLike,
    StatsLike,
    UpdateLike,
)
from inferencecache.index.state import IndexState, Partition, StatsRow
from inferencecache.index.store import HOLD_REMOVED, KEY_REMOVED

TIER_T1 = 1
TIER_T3 = 3
TIER_INVALID = 2**31 - 1
"""Stored tier of a negative (invalid) wire tier: colder than anything
(contract-and-index.md §4.3)."""

_I32_MIN = -(2**31)
_I32_MAX = 2**31 - 1

# ingest_dropped_total{reason} labels (docs/index.md)
DROP_EMPTY_SCHEME = "empty_hash_scheme"
DROP_CHAIN_MISMATCH = "chain_length_mismatch"
DROP_CHAIN_TOO_LONG = "chain_too_long"
DROP_HASH_TOO_LONG = "hash_too_long"
DROP_TOO_MANY_ENTRIES = "too_many_entries"

_F32 = struct.Struct("<f")


def wrap32(x: int) -> int:
    """Two's complement int32 wrap (contract-and-index.md §5.5 "Integers")."""
    return ((x + 0x8000_0000) & 0xFFFF_FFFF) - 0x8000_0000


def normalize_tier(tier: int) -> int:
    """Wire tier -> stored tier (contract-and-index.md §4.3): 0 -> T1, negative -> sentinel, else as
    is."""
    if tier == 0:
        return TIER_T1
    if tier < 0 or tier > TIER_INVALID:
        return TIER_INVALID
    return tier


def report_tier(stored: int) -> int:
    """Stored tier -> ``ReplicaScore.tier``: T1..T3 as is, anything colder UNSPECIFIED."""
    return stored if stored <= TIER_T3 else 0


def f32(x: float) -> float:
    """Round to IEEE float32 (the wire type of hit_rate/pressure and of scores)."""
    try:
        return float(_F32.unpack(_F32.pack(x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


def clean_rate(x: float) -> float:
    """A float32 stats value: NaN/±Inf -> 0, no other clamping (contract-and-index.md §4.2 step
    3)."""
    v = f32(float(x))
    return v if math.isfinite(v) else 0.0


def _stats_of(u: UpdateLike | PackedUpdate) -> StatsLike | None:
    stats = u.stats
    if stats is None:
        return None
    has_field = getattr(u, "HasField", None)  # a protobuf message: presence is explicit
    if has_field is not None and not has_field("stats"):
        return None
    return stats


Entries = Sequence[LegacyRun | PrefixLike]


def _entry_count(items: Entries) -> int:
    return sum(len(x.token_counts) if type(x) is LegacyRun else 1 for x in items)


def _first_entries(items: Entries, limit: int) -> list[LegacyRun | PrefixLike]:
    """The first ``limit`` entries of a compact update (a run may be cut)."""
    out: list[LegacyRun | PrefixLike] = []
    left = limit
    for x in items:
        if left <= 0:
            break
        if type(x) is LegacyRun:
            n = len(x.token_counts)
            if n > left:
                x = LegacyRun(x.hashes[: 8 * left], x.token_counts[:left], x.tier, x.adapter_id)
                n = left
            left -= n
        else:
            left -= 1
        out.append(x)
    return out


def apply_update(
    st: IndexState, u: UpdateLike | PackedUpdate, now_us: int, *, allow_probe: bool = False
) -> bool:
    """Apply one update (contract-and-index.md §4.2 steps 1-3). Returns False when it was skipped
    (probe tenant)."""
    tenant = u.tenant_id
    if tenant == PROBE_TENANT and not allow_probe:
        return False
    ts = u.timestamp_us or now_us
    model = u.model_id
    items: Entries
    if isinstance(u, PackedUpdate):
        items = u.entries
        n_entries = _entry_count(items)
    else:
        items = u.prefixes
        n_entries = len(items)
    if n_entries:
        scheme = u.hash_scheme
        if not scheme:
            st.dropped[DROP_EMPTY_SCHEME] += n_entries
        elif (why := bounds.refuse_holds(st, tenant, model, u.replica_id)) is not None:
            st.dropped[why] += n_entries
        else:
            note_upsert(st, ts)
            if (
                len(items) == 1
                and type(run := items[0]) is LegacyRun
                and n_entries <= st.settings.max_entries_per_update
            ):
                _apply_run(st, u, run, tenant, model, scheme, ts)
            else:
                _apply_prefixes(st, u, items, tenant, model, scheme, ts, n_entries)
    stats = _stats_of(u)
    if stats is not None and (why := bounds.refuse_stats(st, tenant, model, u.replica_id)):
        st.dropped[why] += 1
    elif stats is not None:
        rid = st.replicas.intern(u.replica_id)
        row = StatsRow(
            int(stats.cache_memory_bytes),
            clean_rate(stats.hit_rate),
            clean_rate(stats.pressure),
            int(stats.t2_hit_tokens),
            int(stats.t2_query_tokens),
            ts,
        )
        st.put_stats((tenant, model), rid, row)
        if st.changes is not None:
            st.changes.append(Change(REPLICA_UPDATED, tenant, model, "", u.replica_id, b"", ts))
    return True


def _apply_run(
    st: IndexState,
    u: UpdateLike | PackedUpdate,
    run: LegacyRun,
    tenant: str,
    model: str,
    scheme: str,
    ts: int,
) -> None:
    """An update that is one ``LegacyRun`` (a subscriber's whole update): ``_apply_prefixes``
    without its per-entry machinery; the same rules, the same single store call."""
    counts = run.token_counts
    n = len(counts)
    if len(run.hashes) != 8 * n:
        raise ValueError(f"LegacyRun: {len(run.hashes)} hash bytes for {n} entries")
    rid = st.replicas.intern(u.replica_id)
    if st.settings.max_hash_bytes < 8:
        st.dropped[DROP_HASH_TOO_LONG] += n
        return
    tier = run.tier
    if tier == 0:
        tier = TIER_T1
    elif tier < 0 or tier > TIER_INVALID:
        tier = TIER_INVALID
    if min(counts) < _I32_MIN or max(counts) > _I32_MAX:
        counts = [wrap32(c) for c in counts]
    part = st.partition(tenant, model, scheme, run.adapter_id or u.adapter_id)
    nk, nh = part.ops.upsert_many(run.hashes, counts, rid, ts, tier)
    st.added(part, rid, nk, nh)
    if st.changes is not None:
        st.changes.append(
            Change(PREFIX_ADDED, tenant, model, part.adapter, u.replica_id, run.hashes, ts)
        )


def _apply_prefixes(
    st: IndexState,
    u: UpdateLike | PackedUpdate,
    entries: Entries,
    tenant: str,
    model: str,
    scheme: str,
    ts: int,
    n_entries: int,
) -> None:
    settings = st.settings
    max_entries = settings.max_entries_per_update
    max_blocks = settings.max_blocks_per_entry
    max_hash = settings.max_hash_bytes
    if n_entries > max_entries:
        st.dropped[DROP_TOO_MANY_ENTRIES] += n_entries - max_entries
        if isinstance(u, PackedUpdate):
            entries = _first_entries(entries, max_entries)
        else:
            entries = entries[:max_entries]
    rid = st.replicas.intern(u.replica_id)
    default_adapter = u.adapter_id
    dropped = st.dropped
    # the current batch: one partition (adapter), one stored tier, one key form
    cur_adapter: str | None = None
    cur_tier = 0
    cur_packed = False
    keys: list[bytes] = []
    packed: list[bytes] = []  # LegacyRun hashes, concatenated at the flush
    toks: list[int] = []

    def flush() -> None:
        if cur_adapter is None or not toks:
            return
        part = st.partition(tenant, model, scheme, cur_adapter)
        if packed:
            arg: list[bytes] | bytes = packed[0] if len(packed) == 1 else b"".join(packed)
        else:
            arg = keys
        nk, nh = part.ops.upsert_many(arg, toks, rid, ts, cur_tier)
        st.added(part, rid, nk, nh)
        if st.changes is not None:
            n = len(toks)  # keys beyond the token counts were not written (zip)
            written = arg[: 8 * n] if isinstance(arg, bytes) else list(arg[:n])
            st.changes.append(
                Change(PREFIX_ADDED, tenant, model, cur_adapter, u.replica_id, written, ts)
            )
        keys.clear()
        packed.clear()
        toks.clear()

    for p in entries:
        tier = p.tier
        if tier == 0:
            tier = TIER_T1
        elif tier < 0 or tier > TIER_INVALID:
            tier = TIER_INVALID
        adapter = p.adapter_id or default_adapter
        if isinstance(p, LegacyRun):
            counts = p.token_counts
            n = len(counts)
            if not n:
                continue
            if len(p.hashes) != 8 * n:
                raise ValueError(f"LegacyRun: {len(p.hashes)} hash bytes for {n} entries")
            if max_hash < 8:
                dropped[DROP_HASH_TOO_LONG] += n
                continue
            if min(counts) < _I32_MIN or max(counts) > _I32_MAX:
                counts = [wrap32(c) for c in counts]
            if adapter != cur_adapter or tier != cur_tier or not cur_packed:
                flush()
                cur_adapter = adapter
                cur_tier = tier
                cur_packed = True
            packed.append(p.hashes)
            toks.extend(counts)
            continue
        hashes = p.block_hashes
        counts = p.block_token_counts
        nb = len(hashes)
        nc = len(counts)
        ph = p.prefix_hash
        if nb or nc:
            if nb != nc:
                dropped[DROP_CHAIN_MISMATCH] += 1
                continue
            if nb > max_blocks:
                dropped[DROP_CHAIN_TOO_LONG] += 1
                continue
            if len(ph) > max_hash or max(map(len, hashes)) > max_hash:
                dropped[DROP_HASH_TOO_LONG] += 1
                continue
            cum = list(accumulate(counts))
            if min(cum) < _I32_MIN or max(cum) > _I32_MAX:
                cum = [wrap32(c) for c in cum]
            if adapter != cur_adapter or tier != cur_tier or cur_packed:
                flush()
                cur_adapter = adapter
                cur_tier = tier
                cur_packed = False
            keys.extend(hashes)
            toks.extend(cum)
            if ph:
                keys.append(ph)
                tc = p.token_count
                toks.append(tc if _I32_MIN <= tc <= _I32_MAX else wrap32(tc))
        else:
            if len(ph) > max_hash:
                dropped[DROP_HASH_TOO_LONG] += 1
                continue
            if adapter != cur_adapter or tier != cur_tier or cur_packed:
                flush()
                cur_adapter = adapter
                cur_tier = tier
                cur_packed = False
            keys.append(ph)
            tc = p.token_count
            toks.append(tc if _I32_MIN <= tc <= _I32_MAX else wrap32(tc))
    flush()


_EVICTED = int(EventType.PREFIX_EVICTED)  # plain ints: an enum attribute costs more per event
_CLEARED = int(EventType.ALL_CLEARED)
_UPDATED = int(EventType.REPLICA_UPDATED)


def apply_event(st: IndexState, e: EventLike, now_us: int, *, allow_probe: bool = False) -> bool:
    """Apply one event (contract-and-index.md §4.4). Returns False when skipped (probe tenant)."""
    tenant = e.tenant_id
    if tenant == PROBE_TENANT and not allow_probe:
        return False
    typ = e.type
    if typ == _EVICTED:
        rid = st.replicas.get(e.replica_id)
        parts = st.parts_by_tm.get((tenant, e.model_id))
        if rid is None or not parts:
            return True
        key = e.prefix_hash
        adapter = e.adapter_id
        more = getattr(e, "prefix_hashes", None)
        if st.changes is not None:  # observed: hold by hold, to report exactly what went
            _evict_observed(st, e, rid, parts, [key, *more] if more else [key], now_us)
            return True
        if more:  # batched: the same per-hash rule for every hash, one store call per partition
            keys = [key, *more]
            for part in list(parts.values()):
                if adapter and part.adapter != adapter:
                    continue
                holds, gone = part.ops.remove_holds(keys, rid)
                if holds:
                    st.removed_per_replica(part, {rid: holds}, gone)
            return True
        for part in list(parts.values()):
            if adapter and part.adapter != adapter:
                continue
            bits = part.store.remove_hold(key, rid)
            if bits & HOLD_REMOVED:
                st.removed_per_replica(part, {rid: 1}, 1 if bits & KEY_REMOVED else 0)
    elif typ == _CLEARED:
        rid = st.replicas.get(e.replica_id)
        if rid is None:
            return True
        tm = (tenant, e.model_id)
        for part in list(st.parts_by_tm.get(tm, {}).values()):
            holds, gone = part.ops.remove_replica(rid)
            if holds:
                st.removed_per_replica(part, {rid: holds}, gone)
        st.drop_stats(tm, rid)
        if st.changes is not None:
            st.changes.append(Change(ALL_CLEARED, tenant, e.model_id, "", e.replica_id, b"",
                                     e.timestamp_us or now_us))  # fmt: skip
    elif typ == _UPDATED:
        rid = st.replicas.get(e.replica_id)
        if rid is None:
            return True
        row = st.stats.get((tenant, e.model_id), {}).get(rid)
        if row is not None:
            row.last_seen = e.timestamp_us or now_us
            if st.changes is not None:
                st.changes.append(Change(REPLICA_UPDATED, tenant, e.model_id, "", e.replica_id,
                                         b"", row.last_seen))  # fmt: skip
    return True


def _evict_observed(
    st: IndexState,
    e: EventLike,
    rid: int,
    parts: dict[int, Partition],
    keys: list[bytes],
    now_us: int,
) -> None:
    """``PREFIX_EVICTED`` while the change feed is observed: the same removals, one change per
    partition listing the hashes whose hold was actually removed."""
    adapter = e.adapter_id
    ts = e.timestamp_us or now_us
    changes = st.changes
    assert changes is not None
    for part in list(parts.values()):
        if adapter and part.adapter != adapter:
            continue
        gone: list[bytes] = []
        keys_gone = 0
        for key in keys:
            bits = part.store.remove_hold(key, rid)
            if bits & HOLD_REMOVED:
                gone.append(key)
                keys_gone += 1 if bits & KEY_REMOVED else 0
        if gone:
            st.removed_per_replica(part, {rid: len(gone)}, keys_gone)
            changes.append(Change(PREFIX_EVICTED, part.tenant, part.model, part.adapter,
                                  e.replica_id, gone, ts))  # fmt: skip
