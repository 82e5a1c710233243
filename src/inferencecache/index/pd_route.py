"""LookupPDRoute (contract-and-index.md §5.14): a prefill replica chosen by cache score, a decode
replica chosen by load, within one named topology.

The prefill choice is ``Router.lookup``'s own ranked answer restricted to the topology's prefill
replicas, so partitioning, scoring, gates and freshness are LookupRoute's (no second scorer).
The decode choice reads the replicas' reported pressure under the index lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferencecache.index.lookup_route import Router
from inferencecache.index.model import PROBE_TENANT, LookupRequest, Reason
from inferencecache.index.pd_topology import PDTopology
from inferencecache.index.state import IndexState


class PDReason:
    """LookupPDRoute reason codes beyond LookupRoute's (contract-and-index.md §5.14)."""

    UNKNOWN_TOPOLOGY = "UNKNOWN_TOPOLOGY"
    NO_PREFILL_HINT = "NO_PREFILL_HINT"  # no cache hint: the prefill replica is chosen by load
    NO_PREFILL_REPLICA = "NO_PREFILL_REPLICA"
    NO_DECODE_REPLICA = "NO_DECODE_REPLICA"


_POSITIVE = (Reason.PREFIX_MATCH, Reason.TENANT_HOT)


@dataclass(frozen=True, slots=True)
class PDRequest:
    tenant_id: str
    model_id: str
    prefix_hash: bytes
    prefix_token_count: int
    pd_topology_ref: str


@dataclass(frozen=True, slots=True)
class PDResult:
    reason_code: str
    prefill_replica_id: str = ""
    decode_replica_id: str = ""
    transport_hint: str = ""


def pd_route(router: Router, topology: PDTopology | None, req: PDRequest) -> PDResult:
    """contract-and-index.md §5.14: never raises for a well-typed request."""
    if req.tenant_id == PROBE_TENANT or not req.tenant_id or not req.model_id:
        return PDResult(Reason.NO_HINT)
    if topology is None:
        return PDResult(PDReason.UNKNOWN_TOPOLOGY)
    prefill, reason = _prefill(router, topology, req)
    index = router.index
    ttl_us = index.policy(req.tenant_id).ttl_us
    now_us = index.clock.now_us()
    tenant, model = req.tenant_id, req.model_id
    if not prefill:  # no cache hint: the least loaded live prefill replica
        prefill = index.run_locked(least_pressure, tenant, model, topology.prefill, now_us, ttl_us)
        reason = PDReason.NO_PREFILL_HINT if prefill else PDReason.NO_PREFILL_REPLICA
    decode = index.run_locked(least_pressure, tenant, model, topology.decode, now_us, ttl_us)
    if not decode:
        reason = PDReason.NO_DECODE_REPLICA
    return PDResult(reason, prefill, decode, topology.transport)


def _prefill(router: Router, topology: PDTopology, req: PDRequest) -> tuple[str, str]:
    """(replica, LookupRoute reason) of the best-scored prefill replica, or ("", "")."""
    if not req.prefix_hash:
        return "", ""
    result = router.lookup(
        LookupRequest(
            tenant_id=req.tenant_id,
            model_id=req.model_id,
            hash_scheme=topology.hash_scheme,
            prefix_hash=req.prefix_hash,
            prefix_token_count=req.prefix_token_count,
        )
    )
    if result.reason_code not in _POSITIVE:
        return "", ""
    allowed = set(topology.prefill)
    for score in result.replica_scores:  # ranked best first, ties by replica_id
        if score.replica_id in allowed:
            return score.replica_id, result.reason_code
    return "", ""


def least_pressure(
    st: IndexState,
    tenant: str,
    model: str,
    candidates: Sequence[str],
    now_us: int,
    ttl_us: int,
) -> str:
    """The candidate with the lowest reported pressure among those whose stats row for
    ``(tenant, model)`` is fresh (reported less than ``ttl_us`` ago); ties by replica_id. A
    replica without fresh stats is unknown to be alive, so it is never picked (a stale hint is
    a miss)."""
    rows = st.stats.get((tenant, model))
    if not rows:
        return ""
    wanted = set(candidates)
    names = st.replicas.names
    best: tuple[float, str] | None = None
    for rid, row in rows.items():
        name = names[rid]
        if name is None or name not in wanted:
            continue
        if not row.stats_reported or now_us - row.stats_reported >= ttl_us:
            continue
        pressure = row.pressure if row.pressure == row.pressure else 1.0  # NaN: treat as busy
        key = (pressure, name)
        if best is None or key < best:
            best = key
    return best[1] if best is not None else ""
