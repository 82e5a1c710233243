"""The issue's unbounded-state attack through gRPC: updates naming ever new tenants and
replicas leave at most the configured number of each, the rest counted as dropped."""

from __future__ import annotations

from inferencecache.index.settings import IndexSettings
from inferencecache.server.testing import running_server
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.server.helpers import chain_entry, one_shot, tokens, update


def test_new_tenants_and_replicas_are_bounded() -> None:
    caps = IndexSettings(max_holds=1000, max_tenants=5, max_replicas_per_scope=3,
                         max_stats_rows=6)  # fmt: skip
    with running_server(settings=caps) as srv:
        stub = srv.stub()
        stats = pb.ReplicaStats(hit_rate=0.5)
        msgs = [update(f"r{i}", [chain_entry(tokens(16, i))], tenant=f"t{i}", stats=stats)
                for i in range(200)]  # fmt: skip
        msgs += [update(f"x{i}", [chain_entry(tokens(16, i))], tenant="t0", stats=stats)
                 for i in range(50)]  # fmt: skip
        assert stub.ReportCacheState(one_shot(*msgs), timeout=30).accepted
        index = srv.backend.index
        assert len(index.stats_rows()) == 6
        tenants = {h.partition[0] for h in index.holds()}
        assert len(tenants) == 5
        assert len({h.replica_id for h in index.holds() if h.partition[0] == "t0"}) == 3
        got = {
            reason: srv.metrics.registry.get_sample_value(
                "inferencecache_ingest_dropped_total", {"reason": reason}) or 0
            for reason in ("tenant_cap", "replica_cap", "stats_cap")
        }  # fmt: skip
        assert got["tenant_cap"] >= 195 and got["replica_cap"] >= 47, got
        assert got["stats_cap"] >= 1, got
        assert index.verify() == []
