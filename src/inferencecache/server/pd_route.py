"""The LookupPDRoute method body (contract-and-index.md §5.14): protobuf in, protobuf out, the
decision in ``index.pd_route``. Fail-open like LookupRoute: every answer has status OK.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inferencecache.index.lookup_route import Router
from inferencecache.index.model import Reason
from inferencecache.index.pd_route import PDReason, PDRequest, pd_route
from inferencecache.index.pd_topology import Topologies
from inferencecache.metrics import LazyChildren
from inferencecache.server.metrics import ServerMetrics
from inferencecache.v1alpha1 import inferencecache_pb2 as pb


def _no_topologies() -> Topologies:
    return {}


class PDRoutes:
    """Answers LookupPDRoute from the topologies ``topologies()`` returns (the reloading
    ``--pd-topology-file``; none configured: every ref is ``UNKNOWN_TOPOLOGY``)."""

    def __init__(
        self,
        router: Router,
        metrics: ServerMetrics,
        topologies: Callable[[], Topologies] = _no_topologies,
    ) -> None:
        self._router = router
        self._topologies = topologies
        self._calls = LazyChildren(metrics.pd_route_calls)

    def answer(self, request: Any) -> Any:
        """The response to one decoded ``LookupPDRouteRequest``."""
        req = PDRequest(
            tenant_id=request.tenant_id,
            model_id=request.model_id,
            prefix_hash=bytes(request.prefix_hash),
            prefix_token_count=int(request.prefix_token_count),
            pd_topology_ref=request.pd_topology_ref,
        )
        topology = self._topologies().get(req.pd_topology_ref)
        result = pd_route(self._router, topology, req)
        self._calls(result.reason_code).inc()
        return pb.LookupPDRouteResponse(
            prefill_replica_id=result.prefill_replica_id,
            decode_replica_id=result.decode_replica_id,
            transport_hint=result.transport_hint,
            reason_code=result.reason_code,
        )

    def fail_open(self) -> Any:
        """The answer to a request that could not be decoded or whose handling raised."""
        self._calls(Reason.NO_HINT).inc()
        return pb.LookupPDRouteResponse(reason_code=Reason.NO_HINT)


__all__ = ["PDReason", "PDRoutes"]
