"""Removal policies (contract-and-index.md §6): TTL sweep, tenant quotas, the global hold cap.

Orders are exact: each store returns its smallest candidates by the cheap leading sort fields
plus every tie at the cut (``cap_candidates`` / ``quota_candidates``), and this module finishes
the order across partitions with the full-key tie-break, so the result equals sorting every hold
of the index.
"""

from __future__ import annotations

from collections import Counter

from inferencecache.index.changes import PREFIX_EVICTED, Change
from inferencecache.index.state import IndexState, Partition
from inferencecache.index.store import KEY_REMOVED

REASON_TTL = "ttl"
REASON_CAP = "cap"
REASON_OVER_ENTRIES = "over_entries"


def sweep(st: IndexState, now_us: int) -> None:
    """contract-and-index.md §6.2: drop holds with ``now - last_seen >= ttl(tenant)`` and stats rows
    whose liveness ``last_seen`` is as old. Probe-tenant holds are swept but not counted in the
    metric."""
    evicted: Counter[str] = Counter()
    policies = st.policies
    observed = st.changes is not None
    for part in list(st.parts.values()):
        pol = policies.get(part.tenant)
        if observed and not part.probe:
            _expiring(st, part, now_us - pol.ttl_us)
        per_replica, keys_gone = part.ops.sweep(now_us - pol.ttl_us)
        if per_replica:
            if not part.probe:
                evicted[pol.algorithm] += sum(per_replica.values())
            st.removed_per_replica(part, per_replica, keys_gone)
    for tm, rows in list(st.stats.items()):
        ttl = policies.get(tm[0]).ttl_us
        for rid, row in list(rows.items()):
            if now_us - row.last_seen >= ttl:
                st.drop_stats(tm, rid)
    for algorithm, n in evicted.items():
        st.metrics.index_evictions(algorithm, REASON_TTL, n)


def enforce_quota(st: IndexState, tenant: str) -> None:
    """contract-and-index.md §6.5: while the tenant has more distinct keys than its quota, delete
    whole keys, the key whose newest hold is oldest first, ties by (model, scheme, adapter,
    hash)."""
    quota = st.policies.quotas.get(tenant)
    if quota is None:
        return
    excess = st.keys_by_tenant.get(tenant, 0) - quota
    if excess <= 0:
        return
    cands: list[tuple[int, str, str, str, bytes, Partition]] = []
    for part in st.parts_by_tenant.get(tenant, {}).values():
        for newest, key in part.ops.quota_candidates(excess):
            cands.append((newest, part.model, part.scheme, part.adapter, key, part))
    cands.sort(key=lambda c: c[:5])
    removed = 0
    for _, _, _, _, key, part in cands[:excess]:
        replicas = part.ops.remove_key(key)
        if replicas:
            st.removed_per_replica(part, dict.fromkeys(replicas, 1), 1)
            removed += 1
            if st.changes is not None:
                for rid in replicas:
                    _evicted(st, part, rid, [key])
    if removed:
        st.metrics.tenant_evictions(tenant, REASON_OVER_ENTRIES, removed)


POOL_MIN = 4096
"""Smallest batch of cap candidates computed at once (see ``CapPool``)."""

_NO_TS = -(2**63)


class CapPool:
    """The next global-cap victims in exact contract-and-index.md §6.3 order, computed in batches.

    Finding the smallest holds scans every partition, so at a full index a scan per ingest would
    cost milliseconds per update. Instead one scan yields the ``k`` smallest holds in full order
    and later ingests pop from them. The pool stays exact because every hold outside it sorted
    after ``threshold`` (its last entry) when it was built, and nothing can move a hold in front
    of the threshold without dropping the pool: an upsert whose ``(0, ts)`` is not above the
    threshold's ``(count, last_seen)`` (``note_upsert``), any LFU credit (``drop``), and a config
    swap (``drop``). A popped entry is re-checked against the store (still there, same
    ``last_seen``), which catches holds that were removed or refreshed since.
    """

    __slots__ = ("entries", "pos", "threshold")

    def __init__(
        self, entries: list[tuple[bytes, int, Partition, str, int]], threshold: tuple[int, int]
    ) -> None:
        self.entries = entries  # (key, rid, partition, algorithm, last_seen) in victim order
        self.pos = 0
        self.threshold = threshold  # (effective count, last_seen) of the last entry


def note_upsert(st: IndexState, ts: int) -> None:
    """An ingest is about to write holds with ``last_seen = ts`` (any tenant, any count)."""
    pool = st.cap_pool
    if pool is not None and (0, ts) <= pool.threshold:
        st.cap_pool = None


def _build_pool(st: IndexState, k: int) -> CapPool | None:
    names = st.replicas.names
    policies = st.policies
    cands: list[tuple[int, int, str, str, str, str, bytes, str, int, Partition, str]] = []
    for part in st.parts.values():
        if part.probe:
            continue
        pol = policies.get(part.tenant)
        for eff, ts, key, rid in part.ops.cap_candidates(k, pol.lfu):
            cands.append(
                (
                    eff,
                    ts,
                    part.tenant,
                    part.model,
                    part.scheme,
                    part.adapter,
                    key,
                    names[rid] or "",
                    rid,
                    part,
                    pol.algorithm,
                )
            )
    if not cands:
        return None
    cands.sort(key=lambda c: c[:8])
    del cands[k:]
    last = cands[-1]
    return CapPool([(c[6], c[8], c[9], c[10], c[1]) for c in cands], (last[0], last[1]))


def _still_there(part: Partition, key: bytes, rid: int, last_seen: int) -> bool:
    for r, _tokens, ts, _tier in part.store.holders(key, _NO_TS):
        if r == rid:
            return ts == last_seen
    return False


def enforce_cap(st: IndexState) -> None:
    """contract-and-index.md §6.3: while non-probe holds exceed ``max_holds``, remove the smallest
    by (effective count, last_seen, tenant, model, scheme, adapter, hash, replica_id)."""
    max_holds = st.settings.max_holds
    if max_holds <= 0:
        return
    over = st.total_holds - st.reserved_holds - max_holds
    if over <= 0:
        return
    evicted: Counter[str] = Counter()
    while over > 0:
        pool = st.cap_pool
        if pool is None or pool.pos >= len(pool.entries):
            pool = st.cap_pool = _build_pool(st, max(over, POOL_MIN))
            if pool is None:
                break
        entries = pool.entries
        while over > 0 and pool.pos < len(entries):
            key, rid, part, algorithm, last_seen = entries[pool.pos]
            pool.pos += 1
            if st.parts.get(part.key) is not part or not _still_there(part, key, rid, last_seen):
                continue
            bits = part.store.remove_hold(key, rid)
            if bits:
                st.removed_per_replica(part, {rid: 1}, 1 if bits & KEY_REMOVED else 0)
                evicted[algorithm] += 1
                if st.changes is not None:
                    _evicted(st, part, rid, [key])
                over -= 1
    for algorithm, n in evicted.items():
        st.metrics.index_evictions(algorithm, REASON_CAP, n)


def _evicted(st: IndexState, part: Partition, rid: int, keys: list[bytes]) -> None:
    """Report removed holds to the change feed (only called while it is observed)."""
    assert st.changes is not None
    st.changes.append(Change(PREFIX_EVICTED, part.tenant, part.model, part.adapter,
                             st.replicas.name(rid), keys, st.change_now))  # fmt: skip


def _expiring(st: IndexState, part: Partition, stale_at_or_before: int) -> None:
    """The holds the sweep is about to remove, for the change feed: one O(holds) walk of the
    partition, paid only while someone observes (the stores' sweeps report counts only)."""
    by_replica: dict[int, list[bytes]] = {}
    for h in part.store.holds():
        if h.last_seen <= stale_at_or_before:
            by_replica.setdefault(h.replica, []).append(h.key)
    for rid, keys in by_replica.items():
        _evicted(st, part, rid, keys)
