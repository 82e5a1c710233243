"""Read-only aggregates: the ``/snapshot`` document and GetCacheState
(contract-and-index.md §9.3, §5.13).

Timestamps are rendered like Go's ``time.Time`` JSON (RFC 3339 in UTC, fractional seconds with
trailing zeros trimmed, ``0001-01-01T00:00:00Z`` for "never"). Float32 stats values are emitted
as the shortest decimal that round-trips the float32 (``0.8``, not ``0.800000011920929``), which
is how Go prints a float32 field.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from inferencecache.index.apply import f32
from inferencecache.index.model import PROBE_TENANT, CacheState, ReplicaStatsRow
from inferencecache.index.state import IndexState, StatsRow

ZERO_TIME = "0001-01-01T00:00:00Z"
"""Go's zero ``time.Time`` in JSON: "no stats row" / "no hold"."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_MIN_US = (datetime(1, 1, 1, tzinfo=UTC) - _EPOCH) // _US
_MAX_US = (datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC) - _EPOCH) // _US


def rfc3339_us(us: int) -> str:
    """µs since the epoch -> Go RFC 3339 (nano) text in UTC; clamped to years 1..9999."""
    us = min(max(us, _MIN_US), _MAX_US)
    secs, frac = divmod(us, 1_000_000)
    dt = _EPOCH + timedelta(seconds=secs)
    text = (
        f"{dt.year:04d}-{dt.month:02d}-{dt.day:02d}T{dt.hour:02d}:{dt.minute:02d}:{dt.second:02d}"
    )
    if frac:
        text += "." + f"{frac:06d}".rstrip("0")
    return text + "Z"


def float32_json(x: float) -> float:
    """The shortest decimal that round-trips float32 ``x``, as a Python float (for json)."""
    v = f32(x)
    for digits in range(1, 10):
        candidate = float(f"{v:.{digits}g}")
        if f32(candidate) == v:
            return candidate
    return v


def cache_state(st: IndexState, tenant: str, model: str) -> CacheState:
    """GetCacheState: every stats row of (tenant, model) sorted by replica_id (stale-unswept
    included), distinct keys across schemes and adapters, ``hot_prefixes`` 0."""
    if tenant == PROBE_TENANT:
        return CacheState()
    rows = st.stats.get((tenant, model), {})
    names = st.replicas.names
    out = [
        ReplicaStatsRow(
            replica_id=names[rid] or "",
            cache_memory_bytes=row.cache_memory_bytes,
            hit_rate=row.hit_rate,
            pressure=row.pressure,
            t2_hit_tokens=row.t2_hit_tokens,
            t2_query_tokens=row.t2_query_tokens,
        )
        for rid, row in rows.items()
    ]
    out.sort(key=lambda r: r.replica_id)
    return CacheState(replicas=out, total_prefixes=st.keys_by_tm.get((tenant, model), 0))


class _ReplicaAgg:
    __slots__ = ("holds", "newest", "stats")

    def __init__(self) -> None:
        self.stats: StatsRow | None = None
        self.holds = 0
        self.newest: int | None = None


def snapshot(st: IndexState) -> dict[str, object]:
    """The ``/snapshot`` document (contract-and-index.md §9.3), probe tenant excluded, lists sorted,
    ``[]`` if empty."""
    names = st.replicas.names
    agg: dict[tuple[str, int], _ReplicaAgg] = {}
    # stats: per (tenant, replica) the row with the latest liveness across models (ties: the
    # first model in byte order)
    for tm in sorted(st.stats):
        tenant = tm[0]
        if tenant == PROBE_TENANT:
            continue
        for rid, row in st.stats[tm].items():
            a = agg.get((tenant, rid))
            if a is None:
                a = agg[(tenant, rid)] = _ReplicaAgg()
            if a.stats is None or row.last_seen > a.stats.last_seen:
                a.stats = row
    for part in st.parts.values():
        if part.probe:
            continue
        for rid, (holds, newest) in part.ops.replica_summary().items():
            a = agg.get((part.tenant, rid))
            if a is None:
                a = agg[(part.tenant, rid)] = _ReplicaAgg()
            a.holds += holds
            if a.newest is None or newest > a.newest:
                a.newest = newest

    replicas: list[tuple[tuple[str, str], dict[str, object]]] = []
    rates: dict[str, list[float]] = {}
    for (tenant, rid), a in agg.items():
        name = names[rid] or ""
        doc: dict[str, object] = {"replicaId": name}
        if tenant:
            doc["tenant"] = tenant
        s = a.stats
        doc["cacheMemoryBytes"] = s.cache_memory_bytes if s else 0
        doc["hitRate"] = float32_json(s.hit_rate) if s else 0.0
        doc["pressure"] = float32_json(s.pressure) if s else 0.0
        doc["lastUpdate"] = rfc3339_us(s.last_seen) if s else ZERO_TIME
        doc["prefixCount"] = a.holds
        doc["lastEventAt"] = rfc3339_us(a.newest) if a.newest is not None else ZERO_TIME
        if s is not None:
            doc["statsReported"] = True
            if s.t2_hit_tokens:
                doc["t2HitTokens"] = s.t2_hit_tokens
            if s.t2_query_tokens:
                doc["t2QueryTokens"] = s.t2_query_tokens
            rates.setdefault(tenant, []).append(s.hit_rate)
        replicas.append(((tenant, name), doc))
    replicas.sort(key=lambda x: x[0])

    tenant_ids = {t for t in st.keys_by_tenant if t != PROBE_TENANT}
    tenant_ids.update(tm[0] for tm in st.stats if tm[0] != PROBE_TENANT)
    tenants: list[dict[str, object]] = []
    total = 0
    for tenant in sorted(tenant_ids):
        entries = st.keys_by_tenant.get(tenant, 0)
        total += entries
        tdoc: dict[str, object] = {"tenantId": tenant, "indexEntries": entries}
        tenant_rates = rates.get(tenant)
        if tenant_rates:
            tdoc["hitRate"] = float32_json(sum(tenant_rates) / len(tenant_rates))
            tdoc["hitRateReported"] = True
        else:
            tdoc["hitRate"] = 0.0
        tdoc["memoryUsed"] = 0
        tenants.append(tdoc)
    return {
        "replicas": [doc for _, doc in replicas],
        "tenants": tenants,
        "totalPrefixes": total,
        "hotPrefixes": 0,
    }
