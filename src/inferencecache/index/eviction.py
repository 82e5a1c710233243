"""Removal policies (contract §6): TTL sweep, tenant quotas, the global hold cap.

Orders are exact: each store returns its smallest candidates by the cheap leading sort fields
plus every tie at the cut (``cap_candidates`` / ``quota_candidates``), and this module finishes
the order across partitions with the full-key tie-break, so the result equals sorting every hold
of the index.
"""

from __future__ import annotations

from collections import Counter

from inferencecache.index.state import IndexState, Partition
from inferencecache.index.store import KEY_REMOVED

REASON_TTL = "ttl"
REASON_CAP = "cap"
REASON_OVER_ENTRIES = "over_entries"


def sweep(st: IndexState, now_us: int) -> None:
    """§6.2: drop holds with ``now - last_seen >= ttl(tenant)`` and stats rows whose liveness
    ``last_seen`` is as old. Probe-tenant holds are swept but not counted in the metric."""
    evicted: Counter[str] = Counter()
    policies = st.policies
    for part in list(st.parts.values()):
        pol = policies.get(part.tenant)
        per_replica, keys_gone = part.store.sweep(now_us - pol.ttl_us)
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
    """§6.5: while the tenant has more distinct keys than its quota, delete whole keys, the key
    whose newest hold is oldest first, ties by (model, scheme, adapter, hash)."""
    quota = st.policies.quotas.get(tenant)
    if quota is None:
        return
    excess = st.keys_by_tenant.get(tenant, 0) - quota
    if excess <= 0:
        return
    cands: list[tuple[int, str, str, str, bytes, Partition]] = []
    for part in st.parts_by_tenant.get(tenant, {}).values():
        for newest, key in part.store.quota_candidates(excess):
            cands.append((newest, part.model, part.scheme, part.adapter, key, part))
    cands.sort(key=lambda c: c[:5])
    removed = 0
    for _, _, _, _, key, part in cands[:excess]:
        replicas = part.store.remove_key(key)
        if replicas:
            st.removed_per_replica(part, dict.fromkeys(replicas, 1), 1)
            removed += 1
    if removed:
        st.metrics.tenant_evictions(tenant, REASON_OVER_ENTRIES, removed)


def enforce_cap(st: IndexState) -> None:
    """§6.3: while non-probe holds exceed ``max_holds``, remove the smallest by (effective
    count, last_seen, tenant, model, scheme, adapter, hash, replica_id)."""
    max_holds = st.settings.max_holds
    if max_holds <= 0:
        return
    over = st.total_holds - st.reserved_holds - max_holds
    if over <= 0:
        return
    names = st.replicas.names
    policies = st.policies
    cands: list[tuple[int, int, str, str, str, str, bytes, str, int, Partition, str]] = []
    for part in st.parts.values():
        if part.probe:
            continue
        pol = policies.get(part.tenant)
        for eff, ts, key, rid in part.store.cap_candidates(over, pol.lfu):
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
    cands.sort(key=lambda c: c[:8])
    evicted: Counter[str] = Counter()
    for c in cands[:over]:
        key, rid, part, algorithm = c[6], c[8], c[9], c[10]
        bits = part.store.remove_hold(key, rid)
        if bits:
            st.removed_per_replica(part, {rid: 1}, 1 if bits & KEY_REMOVED else 0)
            evicted[algorithm] += 1
    for algorithm, n in evicted.items():
        st.metrics.index_evictions(algorithm, REASON_CAP, n)
