"""HTTP surfaces (contract-and-index.md §9.2-§9.5) over real HTTP with an aiohttp client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from inferencecache.index.model import PROBE_TENANT
from inferencecache.index.tenant_config import IndexConfig, TenantPolicy
from inferencecache.server.metrics import LATENCY_BUCKETS
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.server.helpers import (
    CONFIG,
    MODEL,
    TENANT,
    chain_entry,
    lookup_chain,
    one_shot,
    tokens,
    update,
    wait_for,
)

TOKEN = "s3cret-token"


@pytest.fixture
def srv() -> Iterator[RunningServer]:
    with running_server(config=CONFIG) as s:
        yield s


@pytest.fixture
def authed() -> Iterator[RunningServer]:
    with running_server(config=CONFIG, admin_token=TOKEN) as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def auth_count(s: RunningServer, endpoint: str, result: str) -> float:
    v = s.metrics.registry.get_sample_value(
        f"inferencecache_{endpoint}_auth_total", {"result": result}
    )
    return v or 0.0


def rejected_count(s: RunningServer, endpoint: str, reason: str) -> float:
    v = s.metrics.registry.get_sample_value(
        "inferencecache_server_admin_rejected_requests_total",
        {"endpoint": endpoint, "reason": reason},
    )
    return v or 0.0


async def test_c10_86_healthz(srv: RunningServer, http: aiohttp.ClientSession) -> None:
    async with http.get(srv.http_url + "/healthz") as r:
        assert r.status == 200
        assert await r.text() == "ok\n"


async def test_c10_86_readyz_503_until_the_sweeper_runs(http: aiohttp.ClientSession) -> None:
    with running_server(config=CONFIG, start_sweeper=False) as s:
        async with http.get(s.http_url + "/readyz") as r:
            assert r.status == 503
            assert await r.text() == "not ready\n"
        s.server.start_sweeper()
        wait_for(lambda: s.server.ready)
        async with http.get(s.http_url + "/readyz") as r:
            assert r.status == 200
            assert await r.text() == "ok\n"


async def test_metrics_exposition(srv: RunningServer, http: aiohttp.ClientSession) -> None:
    stub = srv.stub()
    stub.ReportCacheState(one_shot(update("r1", [chain_entry(tokens(32))])), timeout=10)
    stub.LookupRoute(lookup_chain(tokens(32)), timeout=10)
    async with http.get(srv.http_url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    lines = text.splitlines()
    assert "inferencecache_server_up 1.0" in lines
    assert "inferencecache_server_grpc_tls_enabled 0.0" in lines
    assert (
        'inferencecache_lookup_route_calls_total{hint_used="true",model="m",'
        'reason_code="PREFIX_MATCH"} 1.0' in lines
    )
    assert f'inferencecache_index_entries{{model="{MODEL}"}} 2.0' in lines
    buckets = [
        line.split('le="')[1].split('"')[0]
        for line in lines
        if line.startswith("inferencecache_lookup_route_latency_seconds_bucket{")
    ]
    assert [float(b) for b in buckets[:-1]] == list(LATENCY_BUCKETS)
    assert buckets[-1] == "+Inf"
    assert "# TYPE inferencecache_lookup_route_latency_seconds histogram" in lines


async def test_c10_85_snapshot(srv: RunningServer, http: aiohttp.ClientSession) -> None:
    stub = srv.stub()
    msgs = [
        update("r1", [chain_entry(tokens(48))], stats=pb.ReplicaStats(hit_rate=0.5)),
        update("r2", [chain_entry(tokens(16, 100))], tenant="u"),
        update("rp", [chain_entry(tokens(16))], tenant=PROBE_TENANT),
    ]
    stub.ReportCacheState(iter(msgs), timeout=10)
    async with http.get(srv.admin_url + "/snapshot") as r:
        assert r.status == 200
        assert r.content_type == "application/json"
        doc = await r.json()
    assert doc["totalPrefixes"] == 4
    assert sum(t["indexEntries"] for t in doc["tenants"]) == doc["totalPrefixes"]
    assert [t["tenantId"] for t in doc["tenants"]] == [TENANT, "u"]
    assert PROBE_TENANT not in json.dumps(doc)
    async with http.post(srv.admin_url + "/snapshot") as r:
        assert r.status == 405
        assert r.headers["Allow"] == "GET"


async def test_c10_85_auth_runs_before_the_method_check(
    authed: RunningServer, http: aiohttp.ClientSession
) -> None:
    url = authed.admin_url + "/snapshot"
    async with http.post(url) as r:
        assert r.status == 401
        assert r.headers["WWW-Authenticate"] == "Bearer"
    async with http.get(url, headers=bearer("wrong")) as r:
        assert r.status == 401
    async with http.get(url, headers={"Authorization": f"Basic {TOKEN}"}) as r:
        assert r.status == 401
    async with http.post(url, headers=bearer()) as r:
        assert r.status == 405 and r.headers["Allow"] == "GET"
    async with http.get(url, headers=bearer()) as r:
        assert r.status == 200
    assert auth_count(authed, "snapshot", "unauth") == 3
    assert auth_count(authed, "snapshot", "ok") == 2


async def test_admin_paths_all_require_the_token(
    authed: RunningServer, http: aiohttp.ClientSession
) -> None:
    for path, method in (("/policy", "POST"), ("/probe", "POST")):
        async with http.request(method, authed.admin_url + path, data=b"{}") as r:
            assert r.status == 401
        assert auth_count(authed, path[1:], "unauth") == 1
    # public paths stay open
    async with http.get(authed.http_url + "/metrics") as r:
        assert r.status == 200


async def test_c10_88_policy_v7_absent_min_matched_turns_g1_off(
    http: aiohttp.ClientSession,
) -> None:
    """A v7 ``/policy`` body whose policy omits ``minimumMatchedTokens``, ``routingFloorScore``
    and ``evictionTTL``: G1 off (absent = 0 from version 4), the score floor and the TTL take
    their defaults (0.1, 30 min); the same policy as version 3 → G1 64 and affinity on."""
    config = IndexConfig(policies={TENANT: TenantPolicy()})  # defaults: G1 64, affinity on
    defaults = TenantPolicy()
    assert (defaults.minimum_matched_tokens, defaults.routing_floor_score) == (64, 0.1)
    with running_server(config=config) as s:
        stub = s.stub()
        stub.ReportCacheState(one_shot(update("r1", [chain_entry(tokens(16))])), timeout=10)
        assert stub.LookupRoute(lookup_chain(tokens(16)), timeout=10).reason_code == "AFFINITY_HINT"
        policy: dict[str, object] = {"namespace": TENANT, "affinityRouting": False}
        body: dict[str, object] = {"version": 7, "policies": [policy]}
        async with http.post(s.admin_url + "/policy", json=body) as r:
            assert r.status == 204
        pol = s.backend.index.policy(TENANT)
        assert pol.minimum_matched_tokens == 0  # absent from v4 on: G1 off
        assert pol.routing_floor_score == pytest.approx(0.1)  # absent: the default floor
        assert pol.ttl_us == 30 * 60 * 1_000_000  # evictionTTL absent: 30 min
        # a unique 16-token match (score 16 >= the 0.1 floor) is a PREFIX_MATCH
        resp = stub.LookupRoute(lookup_chain(tokens(16)), timeout=10)
        assert resp.reason_code == "PREFIX_MATCH"
        assert [(x.replica_id, x.matched_tokens) for x in resp.replica_scores] == [("r1", 16)]
        assert 15.9 < resp.replica_scores[0].score <= 16.0  # 16 tokens x freshness (real clock)

        body["version"] = 3  # v3: G1 floor 64 and affinity on again
        async with http.put(s.admin_url + "/policy", json=body) as r:
            assert r.status == 204
        assert s.backend.index.policy(TENANT).minimum_matched_tokens == 64
        assert stub.LookupRoute(lookup_chain(tokens(16)), timeout=10).reason_code == "AFFINITY_HINT"

        # The default floor really applies: every replica of the scope holds the key, so DP
        # makes every score 0 and G2 (floor 0.1) drops them all → NO_HINT (affinity off) ...
        for replica in ("r2", "r3"):
            stub.ReportCacheState(
                one_shot(update(replica, [chain_entry(tokens(16))])), timeout=10
            )
        body["version"] = 7
        async with http.post(s.admin_url + "/policy", json=body) as r:
            assert r.status == 204
        resp = stub.LookupRoute(lookup_chain(tokens(16)), timeout=10)
        assert (resp.reason_code, list(resp.replica_scores)) == ("NO_HINT", [])
        # ... while an explicit routingFloorScore 0 switches G2 off: the same lookup matches
        policy["routingFloorScore"] = 0
        async with http.post(s.admin_url + "/policy", json=body) as r:
            assert r.status == 204
        assert s.backend.index.policy(TENANT).routing_floor_score == 0
        resp = stub.LookupRoute(lookup_chain(tokens(16)), timeout=10)
        assert resp.reason_code == "PREFIX_MATCH"
        assert [(x.replica_id, x.score) for x in resp.replica_scores] == [
            ("r1", 0.0), ("r2", 0.0), ("r3", 0.0)]


async def test_c10_86_replacing_config_restores_defaults(
    srv: RunningServer, http: aiohttp.ClientSession
) -> None:
    stub = srv.stub()
    stub.ReportCacheState(one_shot(update("r1", [chain_entry(tokens(16))])), timeout=10)
    assert stub.LookupRoute(lookup_chain(tokens(16)), timeout=10).reason_code == "PREFIX_MATCH"
    async with http.post(srv.admin_url + "/policy", json={"version": 7}) as r:
        assert r.status == 204
    # tenant t has no entry any more: defaults (G1 floor 64, affinity on)
    assert stub.LookupRoute(lookup_chain(tokens(16)), timeout=10).reason_code == "AFFINITY_HINT"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "invalid JSON"),
        (b'{"version": 2}', "version"),
        (b'{"version": 7, "bogus": 1}', "bogus"),
        (
            b'{"version": 7, "policies": [{"namespace": "t", "minimumPrefixTokens": "x"}]}',
            "policies[0].minimumPrefixTokens",
        ),
        (b"{" + b" " * (1024 * 1024) + b"}", "larger than"),
    ],
)
async def test_bad_input_policy_body_is_400_with_message(
    srv: RunningServer, http: aiohttp.ClientSession, body: bytes, needle: str
) -> None:
    reason = "too_large" if needle == "larger than" else "invalid"
    before = rejected_count(srv, "policy", reason)
    async with http.post(srv.admin_url + "/policy", data=body) as r:
        assert r.status == 400
        assert needle in await r.text()
    assert rejected_count(srv, "policy", reason) == before + 1


async def test_policy_method_check(srv: RunningServer, http: aiohttp.ClientSession) -> None:
    async with http.get(srv.admin_url + "/policy") as r:
        assert r.status == 405
        assert r.headers["Allow"] == "POST, PUT"


async def test_probe(srv: RunningServer, http: aiohttp.ClientSession) -> None:
    body = {"backend": "b1", "model": MODEL, "hashScheme": "vllm"}
    async with http.post(srv.admin_url + "/probe", json=body) as r:
        assert r.status == 200
        doc = await r.json()
    assert doc == {"backend": "b1", "ingest": "ok", "routing": "ok", "t2": "skipped"}
    async with http.get(srv.admin_url + "/snapshot") as r:
        assert (await r.json())["totalPrefixes"] == 0  # cleaned up, and invisible anyway
    async with http.post(srv.admin_url + "/probe", json={"backend": "b1"}) as r:
        assert r.status == 400
    assert rejected_count(srv, "probe", "invalid") == 1
    async with http.post(srv.admin_url + "/probe", data=b"x" * 5000) as r:
        assert r.status == 400
    assert rejected_count(srv, "probe", "too_large") == 1
    async with http.get(srv.admin_url + "/probe") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"


async def test_admin_address_moves_admin_paths(http: aiohttp.ClientSession) -> None:
    with running_server(config=CONFIG, separate_admin=True) as s:
        assert s.server.admin_port not in (None, s.server.http_port)
        async with http.get(s.http_url + "/snapshot") as r:
            assert r.status == 404
        async with http.get(s.admin_url + "/snapshot") as r:
            assert r.status == 200
        async with http.get(s.http_url + "/healthz") as r:
            assert r.status == 200
        async with http.get(s.admin_url + "/healthz") as r:
            assert r.status == 404


async def test_server_up_drops_to_zero_on_stop() -> None:
    with running_server(config=CONFIG) as s:
        up = s.metrics.registry.get_sample_value("inferencecache_server_up")
        assert up == 1
        s.server.stop(0)
        assert s.metrics.registry.get_sample_value("inferencecache_server_up") == 0
