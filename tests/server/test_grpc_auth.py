"""gRPC credentials (issue 15 item 2): roles, tenants, token hashes, reload, the one
``Authorizer`` shared by every method and the HTTP lookup listener; the poisoning scenario of
the issue through a real gRPC server."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inferencecache.index.tenant_config import IndexConfig
from inferencecache.server import auth
from inferencecache.server.auth import (
    PERMISSION_DENIED,
    UNAUTHENTICATED,
    AuthConfigError,
    Authorizer,
    CredentialsFile,
    Denied,
    parse_credentials,
    token_sha256,
)
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.server.helpers import PERMISSIVE, chain_entry, lookup_chain, one_shot, tokens, update

CONFIG = IndexConfig(policies={"victim": PERMISSIVE, "attacker": PERMISSIVE})
TOKENS = {"victim-producer": "vp-secret", "victim-reader": "vr-secret",
          "attacker": "at-secret", "ops": "ops-secret"}  # fmt: skip


def credentials_text() -> str:
    return "\n".join([
        "# name roles tenants secret...",
        f"victim-producer producer victim {token_sha256(TOKENS['victim-producer'])}",
        f"victim-reader reader victim {token_sha256(TOKENS['victim-reader'])}",
        f"attacker admin attacker {token_sha256(TOKENS['attacker'])}",
        f"ops admin * {token_sha256(TOKENS['ops'])}  # every tenant",
    ]) + "\n"  # fmt: skip


def md(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[name]}"),)


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[RunningServer]:
    path = tmp_path / "credentials"
    path.write_text(credentials_text())
    with running_server(config=CONFIG, credentials_file=str(path), lookup_http=True) as s:
        yield s


def code_of(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def outcome(s: RunningServer, method: str, result: str) -> float:
    v = s.metrics.registry.get_sample_value(
        "inferencecache_server_grpc_auth_total", {"method": method, "outcome": result}
    )
    return v or 0.0


# -- the file ---------------------------------------------------------------------------------


def test_credentials_file_parses_roles_tenants_and_secrets() -> None:
    creds = parse_credentials(credentials_text() + "edge reader,producer a,b cert:edge-1\n")
    by = {c.name: c for c in creds}
    assert by["victim-producer"].roles == {"producer"}
    assert by["victim-producer"].tenants == frozenset({"victim"})
    assert by["ops"].tenants is None and by["ops"].roles == {"producer", "reader"}
    assert by["edge"].tenants == frozenset({"a", "b"}) and by["edge"].cert_names == {"edge-1"}
    assert by["edge"].token_sha256 == ()
    assert by["victim-reader"].may("reader", "victim")
    assert not by["victim-reader"].may("producer", "victim")
    assert not by["victim-reader"].may("reader", "attacker")
    assert not by["victim-reader"].may("reader", None)  # an every-tenant request
    assert by["ops"].may("reader", None)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("a reader", "want <name>"),
        ("a writer * sha256:" + "0" * 64, "unknown role 'writer'"),
        ("a reader * sha256:abc", "64 hex"),
        ("a reader * plain", "sha256:<hex> or cert:<name>"),
        ("a reader *,x sha256:" + "0" * 64, "tenants must be"),
        ("a reader * cert:x\na reader * cert:y", "appears twice"),
    ],
)
def test_bad_input_credentials_file_names_the_line(line: str, needle: str) -> None:
    with pytest.raises(AuthConfigError, match="line") as e:
        parse_credentials(line)
    assert needle in str(e.value)


def test_only_hashes_are_kept_and_auth_off_lets_everyone_in() -> None:
    creds = parse_credentials(credentials_text())
    assert all(TOKENS[c.name].encode() not in b"".join(c.token_sha256) for c in creds)
    assert all(len(h) == 32 for c in creds for h in c.token_sha256)
    a = Authorizer(None)
    assert not a.required and a.authorize("ReportCacheState", None).name == "(auth off)"
    with pytest.raises(Denied) as e:
        Authorizer(None, mtls=True).authorize("LookupRoute", "Basic abc")
    assert e.value.code == UNAUTHENTICATED


def test_credentials_file_reloads_and_a_broken_edit_keeps_the_last_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(auth, "RELOAD_EVERY_S", 0.0)
    path = tmp_path / "creds"
    path.write_text(f"one reader * {token_sha256('t1')}\n")
    a = Authorizer(CredentialsFile(str(path)))
    assert a.authorize("LookupRoute", "Bearer t1").name == "one"
    with pytest.raises(Denied) as e:
        a.authorize("LookupRoute", "Bearer t2")
    assert e.value.code == UNAUTHENTICATED
    path.write_text(f"two reader * {token_sha256('t2')}\n")
    assert a.authorize("LookupRoute", "Bearer t2").name == "two"
    with pytest.raises(Denied):
        a.authorize("LookupRoute", "Bearer t1")  # revoked by the edit
    path.write_text("two reader * sha256:nothex and more\n")  # a broken edit
    time.sleep(0.01)
    assert a.authorize("LookupRoute", "Bearer t2").name == "two"
    with pytest.raises(Denied) as e:
        a.authorize("ReportCacheState", "Bearer t2")
    assert e.value.code == PERMISSION_DENIED


# -- through gRPC -----------------------------------------------------------------------------


def test_poisoning_scenario_is_refused(srv: RunningServer) -> None:
    """The issue's attack with auth on: reading another tenant's state without a credential is
    UNAUTHENTICATED; an attacker's producer credential (tenant "attacker") injecting holds and
    ALL_CLEARED into tenant "victim" is PERMISSION_DENIED; the victim still routes to its real
    replica."""
    stub = srv.stub()
    toks = tokens(64)
    ack = stub.ReportCacheState(
        one_shot(update("real", [chain_entry(toks)], tenant="victim")),
        timeout=10, metadata=md("victim-producer"),
    )  # fmt: skip
    assert ack.accepted
    state = pb.GetCacheStateRequest(tenant_id="victim", model_id="m")
    assert code_of(lambda: stub.GetCacheState(state, timeout=10)) == \
        grpc.StatusCode.UNAUTHENTICATED  # fmt: skip
    assert code_of(lambda: stub.GetCacheState(state, timeout=10, metadata=md("attacker"))) == \
        grpc.StatusCode.PERMISSION_DENIED  # fmt: skip
    inject = update("attacker-replica", [chain_entry(toks)], tenant="victim")
    assert code_of(lambda: stub.ReportCacheState(one_shot(inject), timeout=10,
                                                 metadata=md("attacker"))) == \
        grpc.StatusCode.PERMISSION_DENIED  # fmt: skip
    clear = pb.CacheEvent(type=pb.CacheEvent.ALL_CLEARED, replica_id="real", model_id="m",
                          tenant_id="victim")  # fmt: skip
    assert code_of(lambda: stub.PublishEvent(clear, timeout=10, metadata=md("attacker"))) == \
        grpc.StatusCode.PERMISSION_DENIED  # fmt: skip
    # the victim's producer may not read, its reader may not write
    assert code_of(lambda: stub.PublishEvent(clear, timeout=10,
                                             metadata=md("victim-reader"))) == \
        grpc.StatusCode.PERMISSION_DENIED  # fmt: skip
    resp = stub.LookupRoute(lookup_chain(toks, tenant="victim"), timeout=10,
                            metadata=md("victim-reader"))  # fmt: skip
    assert resp.reason_code == "PREFIX_MATCH"
    assert [s.replica_id for s in resp.replica_scores] == ["real"]
    assert outcome(srv, "ReportCacheState", "permission_denied") == 1
    assert outcome(srv, "PublishEvent", "permission_denied") == 2
    assert outcome(srv, "GetCacheState", "unauthenticated") == 1
    assert outcome(srv, "LookupRoute", "ok") == 1
    own = stub.GetCacheState(state, timeout=10, metadata=md("victim-reader"))
    assert [r.replica_id for r in own.replicas] == [] and own.summary.total_prefixes > 0


def test_lookup_without_or_with_a_wrong_credential(srv: RunningServer) -> None:
    stub = srv.stub()
    req = lookup_chain(tokens(32), tenant="victim")
    assert code_of(lambda: stub.LookupRoute(req, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    bad = (("authorization", "Bearer not-a-token"),)
    assert code_of(lambda: stub.LookupRoute(req, timeout=10, metadata=bad)) == \
        grpc.StatusCode.UNAUTHENTICATED  # fmt: skip
    assert code_of(lambda: stub.LookupRoute(req, timeout=10, metadata=md("attacker"))) == \
        grpc.StatusCode.PERMISSION_DENIED  # fmt: skip
    assert stub.LookupRoute(req, timeout=10, metadata=md("ops")).reason_code == "NO_HINT"
    assert outcome(srv, "LookupRoute", "unauthenticated") == 2


def test_stream_checks_every_update_and_keeps_the_earlier_ones(srv: RunningServer) -> None:
    """A ReportCacheState stream is checked per update: the attacker's own-tenant update is
    applied, the stream ends PERMISSION_DENIED at the first update naming another tenant."""
    stub = srv.stub()
    toks = tokens(48)
    msgs = one_shot(update("a1", [chain_entry(toks)], tenant="attacker"),
                    update("a1", [chain_entry(toks)], tenant="victim"),
                    update("a2", [chain_entry(toks)], tenant="attacker"))  # fmt: skip
    assert code_of(lambda: stub.ReportCacheState(msgs, timeout=10, metadata=md("attacker"))) == \
        grpc.StatusCode.PERMISSION_DENIED  # fmt: skip
    resp = stub.LookupRoute(lookup_chain(toks, tenant="attacker"), timeout=10,
                            metadata=md("attacker"))  # fmt: skip
    assert [s.replica_id for s in resp.replica_scores] == ["a1"]
    victim = stub.LookupRoute(lookup_chain(toks, tenant="victim"), timeout=10,
                              metadata=md("ops"))  # fmt: skip
    assert victim.reason_code != "PREFIX_MATCH" and not victim.replica_scores
    assert not srv.metrics.registry.get_sample_value(
        "inferencecache_server_report_stream_errors_total", {"reason": "cancelled"})


def test_unfiltered_streams_need_an_every_tenant_credential(srv: RunningServer) -> None:
    stub = srv.stub()
    def first(name: str) -> grpc.StatusCode:
        return code_of(lambda: list(stub.StreamMetrics(pb.StreamMetricsRequest(), timeout=10,
                                                       metadata=md(name))))  # fmt: skip
    assert first("victim-reader") == grpc.StatusCode.PERMISSION_DENIED
    stream = stub.StreamMetrics(pb.StreamMetricsRequest(), timeout=60, metadata=md("ops"))
    try:
        assert isinstance(next(stream), pb.Metric)  # an every-tenant credential is served
    finally:
        stream.cancel()
    ev = pb.StreamEventsRequest(tenant_id="")
    assert code_of(lambda: list(stub.StreamCacheEvents(ev, timeout=10,
                                                       metadata=md("victim-reader")))) == \
        grpc.StatusCode.PERMISSION_DENIED  # fmt: skip


def test_probe_tenant_is_open_to_any_credential_with_the_role(srv: RunningServer) -> None:
    """The doctor's probe (reserved tenant, never visible) works with a tenant-bound
    credential that holds both roles."""
    from inferencecache.index.model import PROBE_TENANT

    stub = srv.stub()
    up = update("__probe-x", [chain_entry(tokens(16))], tenant=PROBE_TENANT)
    assert stub.ReportCacheState(one_shot(up), timeout=10, metadata=md("attacker")).accepted


def _post(url: str, body: bytes, token: str | None) -> int:
    headers = {"Content-Type": "application/x-protobuf"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + "/v1/lookup", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_http_lookup_listener_uses_the_same_check(srv: RunningServer) -> None:
    body = lookup_chain(tokens(32), tenant="victim").SerializeToString()
    assert _post(srv.lookup_url, body, None) == 401
    assert _post(srv.lookup_url, body, "wrong") == 401
    assert _post(srv.lookup_url, body, TOKENS["attacker"]) == 403
    assert _post(srv.lookup_url, body, TOKENS["victim-reader"]) == 200
    assert outcome(srv, "http:/v1/lookup", "permission_denied") == 1


def test_health_and_reflection_need_no_credential(srv: RunningServer) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(srv.channel())  # type: ignore[no-untyped-call]
    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert isinstance(srv.stub(), pb_grpc.InferenceCacheStub)
