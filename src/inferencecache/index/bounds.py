"""Per-producer state bounds: how many tenants, replicas per (tenant, model) and stats rows the
index keeps, so a producer naming ever new tenants or replicas cannot grow the server's memory
without end (the hold cap, ``eviction.enforce_cap``, bounds only holds; docs/index.md).

New state beyond a bound is refused, never evicted: existing tenants and replicas keep their
hints while the newcomer's update is dropped and counted under ``ingest_dropped{reason}``
(``tenant_cap``, ``replica_cap``, ``stats_cap``). 0 = unbounded. The probe tenant is exempt.
"""

from __future__ import annotations

from typing import Final

from inferencecache.index.model import PROBE_TENANT
from inferencecache.index.state import IndexState

DROP_TENANT_CAP: Final = "tenant_cap"
DROP_REPLICA_CAP: Final = "replica_cap"
DROP_STATS_CAP: Final = "stats_cap"


def refuse_holds(st: IndexState, tenant: str, model: str, replica: str) -> str | None:
    """Why holds of ``replica`` in ``(tenant, model)`` would exceed a bound (None: they fit)."""
    if tenant == PROBE_TENANT:
        return None
    settings = st.settings
    if settings.max_tenants and tenant not in st.tenant_refs \
            and len(st.tenant_refs) >= settings.max_tenants:  # fmt: skip
        return DROP_TENANT_CAP
    cap = settings.max_replicas_per_scope
    if cap:
        by = st.replicas_by_tm.get((tenant, model))
        if by is not None and len(by) >= cap:
            rid = st.replicas.get(replica)
            if rid is None or rid not in by:
                return DROP_REPLICA_CAP
    return None


def refuse_stats(st: IndexState, tenant: str, model: str, replica: str) -> str | None:
    """Why a stats row of ``replica`` would exceed a bound (None: it fits or exists)."""
    if tenant == PROBE_TENANT:
        return None
    rows = st.stats.get((tenant, model))
    if rows is not None:
        rid = st.replicas.get(replica)
        if rid is not None and rid in rows:
            return None  # an update of an existing row
    cap = st.settings.max_stats_rows
    if cap and st.stats_rows >= cap:
        return DROP_STATS_CAP
    return refuse_holds(st, tenant, model, replica)
