"""StreamCacheEvents and StreamMetrics through a real gRPC client (contract-and-index.md §13)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from inferencecache import fingerprint
from inferencecache.index.settings import IndexSettings
from inferencecache.index.tenant_config import IndexConfig, TenantPolicy, TenantQuota
from inferencecache.server.streams import StreamSettings
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.server.helpers import CONFIG, MODEL, TENANT, chain_entry, tokens, update, wait_for

_E = pb.CacheEvent
ADDED, EVICTED = _E.PREFIX_ADDED, _E.PREFIX_EVICTED
UPDATED, CLEARED = _E.REPLICA_UPDATED, _E.ALL_CLEARED


class Reader:
    """Reads a server stream on a thread into ``items`` until cancelled or ended."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.items: list[Any] = []
        self.error: grpc.RpcError | None = None
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            for item in self.call:
                self.items.append(item)
        except grpc.RpcError as e:
            self.error = e

    def wait(self, n: int) -> list[Any]:
        wait_for(lambda: len(self.items) >= n or self.error is not None, timeout=20)
        return self.items

    def stop(self) -> None:
        self.call.cancel()
        self._t.join(10)


def _open(srv: RunningServer, req: pb.StreamEventsRequest, observers: int = 1) -> Reader:
    r = Reader(srv.stub().StreamCacheEvents(req, timeout=60))
    wait_for(lambda: srv.backend.index.feed.count >= observers, timeout=20)
    return r


def _short(ev: Any) -> tuple[int, str, str, str, bytes]:
    return ev.type, ev.replica_id, ev.tenant_id, ev.model_id, ev.prefix_hash


@pytest.fixture
def srv() -> Iterator[RunningServer]:
    with running_server(config=CONFIG) as s:
        yield s


def test_c13_1_and_c13_2_updates_and_events_stream_in_apply_order(srv: RunningServer) -> None:
    stub = srv.stub()
    r = _open(srv, pb.StreamEventsRequest())
    hashes, _ = fingerprint.chain(tokens(32), 16)
    stub.ReportCacheState(
        iter([update("r1", [chain_entry(tokens(32))], stats=pb.ReplicaStats(hit_rate=0.5))]),
        timeout=10,
    )
    ev = pb.CacheEvent
    stub.PublishEvent(ev(type=EVICTED, replica_id="r1", tenant_id=TENANT, model_id=MODEL,
                         prefix_hash=hashes[1]), timeout=10)  # fmt: skip
    stub.PublishEvent(ev(type=EVICTED, replica_id="r1", tenant_id=TENANT, model_id=MODEL,
                         prefix_hash=b"nothere!"), timeout=10)  # nothing removed: nothing streamed
    stub.PublishEvent(ev(type=UPDATED, replica_id="r1", tenant_id=TENANT, model_id=MODEL,
                         timestamp_us=123), timeout=10)  # fmt: skip
    stub.PublishEvent(ev(type=CLEARED, replica_id="r1", tenant_id=TENANT, model_id=MODEL),
                      timeout=10)  # fmt: skip
    got = r.wait(6)
    r.stop()
    assert [_short(e) for e in got] == [
        (ADDED, "r1", TENANT, MODEL, hashes[0]),
        (ADDED, "r1", TENANT, MODEL, hashes[1]),
        (UPDATED, "r1", TENANT, MODEL, b""),
        (EVICTED, "r1", TENANT, MODEL, hashes[1]),
        (UPDATED, "r1", TENANT, MODEL, b""),
        (CLEARED, "r1", TENANT, MODEL, b""),
    ]
    assert got[4].timestamp_us == 123
    assert all(e.timestamp_us > 0 for e in got)
    assert not any(e.prefix_hashes for e in got)


def test_c13_1_filters_by_tenant_model_and_types(srv: RunningServer) -> None:
    stub = srv.stub()
    only = _open(srv, pb.StreamEventsRequest(tenant_id="t2", model_id="m2", types=[UPDATED]))
    added = _open(srv, pb.StreamEventsRequest(types=[ADDED]), observers=2)
    stub.ReportCacheState(iter([
        update("a", [chain_entry(tokens(16))], stats=pb.ReplicaStats(hit_rate=0.1)),
        update("b", [chain_entry(tokens(16))], tenant="t2", stats=pb.ReplicaStats()),
        update("c", [chain_entry(tokens(16))], tenant="t2", model="m2",
               stats=pb.ReplicaStats()),
    ]), timeout=10)  # fmt: skip
    assert [_short(e) for e in only.wait(1)] == [(UPDATED, "c", "t2", "m2", b"")]
    assert [e.replica_id for e in added.wait(3)] == ["a", "b", "c"]
    assert {e.type for e in added.items} == {ADDED}
    only.stop()
    added.stop()
    assert len(only.items) == 1


def test_c13_1_probe_tenant_stream_ends_at_once(srv: RunningServer) -> None:
    call = srv.stub().StreamCacheEvents(
        pb.StreamEventsRequest(tenant_id="inferencecache.io/probe"), timeout=10
    )
    assert list(call) == []
    assert call.code() == grpc.StatusCode.OK


def test_c13_1_sweep_quota_and_cap_evictions_stream() -> None:
    config = IndexConfig(
        policies={TENANT: TenantPolicy(minimum_matched_tokens=0)},
        quotas={"q": TenantQuota(max_index_entries=1)},
    )
    with running_server(config=config, settings=IndexSettings(max_holds=2)) as srv:
        stub = srv.stub()
        r = _open(srv, pb.StreamEventsRequest(types=[EVICTED]))
        h, _ = fingerprint.chain(tokens(48), 16)
        # quota 1 for tenant q: the second key evicts the first
        stub.ReportCacheState(iter([update("q1", [chain_entry(tokens(32))], tenant="q")]),
                              timeout=10)  # fmt: skip
        got = r.wait(1)
        assert _short(got[0])[:4] == (EVICTED, "q1", "q", MODEL)
        held = {v.key for v in srv.backend.index.holds() if v.partition[0] == "q"}
        assert len(held) == 1 and {got[0].prefix_hash} | held == set(h[:2])
        # cap 2 (the q hold counts): one more hold on top evicts the oldest
        stub.ReportCacheState(iter([update("c1", [chain_entry(tokens(32))], timestamp_us=1)]),
                              timeout=10)  # fmt: skip
        got = r.wait(2)
        assert _short(got[1])[:4] == (EVICTED, "c1", TENANT, MODEL)  # the oldest (ts 1)
        # the sweep: the other c1 hold (stamped 1 µs after the epoch) is past any TTL
        srv.backend.index.sweep()
        assert srv.backend.index.counts()["holds"] == 1  # the fresh q hold
        got = r.wait(3)
        assert _short(got[2])[:4] == (EVICTED, "c1", TENANT, MODEL)
        assert {got[1].prefix_hash, got[2].prefix_hash} == set(h[:2])
        r.stop()
        assert {e.type for e in got} == {EVICTED}
        assert len(got) == 3  # quota 1 + cap 1 + the one hold the sweep expired


def test_c13_3_slow_observer_is_cut_off_with_resource_exhausted() -> None:
    with running_server(config=CONFIG, streams=StreamSettings(max_backlog=3)) as srv:
        r = _open(srv, pb.StreamEventsRequest())
        # one update, five adapters: five changes in one apply, more than the backlog of 3
        entries = [chain_entry(tokens(16), adapter=f"a{i}") for i in range(5)]
        srv.stub().ReportCacheState(iter([update("r", entries)]), timeout=10)
        wait_for(lambda: r.error is not None, timeout=20)
        assert r.error is not None
        assert r.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "behind" in (r.error.details() or "")
        assert srv.backend.index.feed.count == 0
        value = srv.metrics.registry.get_sample_value(
            "inferencecache_server_stream_disconnects_total",
            {"method": "StreamCacheEvents", "reason": "overflow"},
        )
        assert value == 1
        # ingest goes on, and a new observer is served
        srv.stub().ReportCacheState(iter([update("r", [chain_entry(tokens(32))])]), timeout=10)
        assert srv.backend.index.counts()["holds"] == 7


def test_c13_4_streams_beyond_the_cap_are_refused_and_unary_rpcs_still_run() -> None:
    with running_server(config=CONFIG, streams=StreamSettings(max_streams=1)) as srv:
        stub = srv.stub()
        r = _open(srv, pb.StreamEventsRequest())
        for call in (stub.StreamCacheEvents(pb.StreamEventsRequest(), timeout=10),
                     stub.StreamMetrics(pb.StreamMetricsRequest(), timeout=10)):  # fmt: skip
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams 1" in (e.value.details() or "")
        g = stub.GetCacheState(pb.GetCacheStateRequest(tenant_id=TENANT, model_id=MODEL),
                               timeout=10)  # fmt: skip
        assert g.summary.total_prefixes == 0
        reg = srv.metrics.registry
        assert reg.get_sample_value("inferencecache_server_open_streams",
                                    {"method": "StreamCacheEvents"}) == 1  # fmt: skip
        r.stop()
        # the slot comes back once the cancel is seen
        wait_for(lambda: reg.get_sample_value("inferencecache_server_open_streams",
                                              {"method": "StreamCacheEvents"}) == 0, timeout=20)
        m = stub.StreamMetrics(pb.StreamMetricsRequest(names=["inferencecache_server_up"]),
                               timeout=10)  # fmt: skip
        assert next(m).name == "inferencecache_server_up"
        m.cancel()


def test_c13_4_clamped_to_half_the_workers() -> None:
    with running_server(grpc_workers=4, streams=StreamSettings(max_streams=100)) as srv:
        assert srv.server.streams.settings.max_streams == 2


def test_c13_4_shutdown_ends_open_streams_with_ok() -> None:
    with running_server(config=CONFIG) as srv:
        r = _open(srv, pb.StreamEventsRequest())
        srv.server.stop(30)
        r._t.join(20)
        assert not r._t.is_alive()
        assert r.error is None
        assert r.call.code() == grpc.StatusCode.OK


def test_c13_5_metrics_rounds_filtered_by_sample_or_family_name() -> None:
    settings = StreamSettings(metrics_interval=0.05)
    with running_server(config=CONFIG, streams=settings) as srv:
        stub = srv.stub()
        stub.LookupRoute(pb.LookupRouteRequest(tenant_id=TENANT, model_id=MODEL,
                                               hash_scheme="vllm", prefix_hash=b"x" * 8),
                         timeout=10)  # fmt: skip
        call = stub.StreamMetrics(pb.StreamMetricsRequest(names=[
            "inferencecache_server_up", "inferencecache_lookup_route_latency_seconds"]),
            timeout=30)  # fmt: skip
        rounds: dict[int, list[Any]] = {}
        for m in call:
            rounds.setdefault(m.timestamp_us, []).append(m)
            if len(rounds) == 3:
                break
        call.cancel()
        stamps = sorted(rounds)
        assert len(stamps) == 3 and stamps[0] < stamps[1] < stamps[2]
        first = rounds[stamps[0]]
        names = {m.name for m in first}
        assert names == {
            "inferencecache_server_up",
            "inferencecache_lookup_route_latency_seconds_bucket",
            "inferencecache_lookup_route_latency_seconds_sum",
            "inferencecache_lookup_route_latency_seconds_count",
        }
        up = [m for m in first if m.name == "inferencecache_server_up"]
        assert [(m.type, m.value, dict(m.labels)) for m in up] == [("gauge", 1.0, {})]
        count = [m for m in first if m.name.endswith("_count")]
        assert [(m.type, m.value, dict(m.labels)) for m in count] == [
            ("histogram", 1.0, {"model": MODEL})
        ]
        assert any(m.labels.get("le") == "+Inf" for m in first)
        # a counter by its sample name
        call = stub.StreamMetrics(pb.StreamMetricsRequest(
            names=["inferencecache_lookup_route_calls_total"]), timeout=30)  # fmt: skip
        m = next(call)
        call.cancel()
        assert (m.name, m.type, m.value) == ("inferencecache_lookup_route_calls_total",
                                             "counter", 1.0)  # fmt: skip
        assert m.labels["reason_code"] == "NO_HINT"


def test_c13_1_many_observers_see_the_same_changes_in_the_same_order(srv: RunningServer) -> None:
    readers = [_open(srv, pb.StreamEventsRequest(), observers=i + 1) for i in range(8)]
    stub = srv.stub()
    for i in range(5):
        stub.ReportCacheState(iter([update(f"r{i}", [chain_entry(tokens(32, 100 * i))])]),
                              timeout=10)  # fmt: skip
    want = [(_E.PREFIX_ADDED, f"r{i}") for i in range(5) for _ in range(2)]
    for r in readers:
        assert [(e.type, e.replica_id) for e in r.wait(10)] == want
    lookup = stub.LookupRoute(pb.LookupRouteRequest(tenant_id=TENANT, model_id=MODEL,
                                                    hash_scheme="vllm",
                                                    token_ids=tokens(32)), timeout=10)  # fmt: skip
    assert lookup.reason_code == "PREFIX_MATCH"  # unary RPCs run beside 8 open streams
    for r in readers:
        r.stop()
