"""No single request stops the server (issue 15 item 1): the worst protobuf shapes over real
gRPC into every method of a running server, the worst admin bodies over real HTTP, and bugs
injected into the handlers, the admin paths and the sweeper. Each time the request is answered
(fail-open, INVALID_ARGUMENT, 400 or INTERNAL), counted, and a valid request afterwards works."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from inferencecache import fingerprint, varint
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.supervise import DROP_REASONS
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.server.helpers import (
    CONFIG,
    MODEL,
    SCHEME,
    TENANT,
    chain_entry,
    tokens,
    update,
    wait_for,
)

SERVICE = "inferencecache.v1alpha1.InferenceCache"
MAX_MESSAGE = 16 * 1024 * 1024


def tag(field: int, wire_type: int) -> bytes:
    return varint.encode(field << 3 | wire_type)


def worst_protobuf() -> dict[str, bytes]:
    """Request bodies no client library writes; field 1 is a string in every request here."""
    million_hashes = b"".join(tag(7, 2) + b"\x08" + i.to_bytes(8, "big")
                              for i in range(1_000_000))
    return {
        "deep_groups": tag(999, 3) * 100_000 + tag(999, 4) * 100_000,
        "deep_groups_unclosed": tag(999, 3) * 1_000_000,
        "deep_groups_mismatched": tag(999, 3) * 1000 + tag(998, 4),
        "huge_length": tag(1, 2) + b"\xff" * 9 + b"\x01",
        "huge_length_u32": tag(1, 2) + b"\xff\xff\xff\xff\x0f",
        "varint_2_64_minus_1": tag(4, 0) + b"\xff" * 9 + b"\x01",
        "varint_11_bytes": tag(4, 0) + b"\xff" * 10 + b"\x01",
        "tag_11_bytes": b"\xff" * 10 + b"\x01",
        "field_0": tag(0, 0) + b"\x01",
        "field_2_29": tag(2**29, 0) + b"\x01",
        "field_2_29_plus_1": varint.encode(((2**29) << 3) | 0) + b"\x01",
        "wire_type_6": tag(1, 6),
        "wire_type_7": tag(1, 7),
        "invalid_utf8": tag(1, 2) + b"\x03\xff\xfe\xfd",
        "surrogate_utf8": tag(1, 2) + b"\x03\xed\xa0\x80",
        "truncated_fixed64": tag(999, 1) + b"\x00" * 3,
        "million_hashes": tag(1, 2) + b"\x01m" + million_hashes,
        "million_unknown_fields": (tag(999, 0) + b"\x01") * 1_000_000,
        "empty": b"",
    }


def raw_unary(srv: RunningServer, method: str) -> grpc.UnaryUnaryMultiCallable:
    return srv.channel().unary_unary(f"/{SERVICE}/{method}")


def server_drops(srv: RunningServer, loop: str) -> float:
    total = 0.0
    for reason in DROP_REASONS:
        v = srv.metrics.registry.get_sample_value(
            "inferencecache_server_dropped_inputs_total", {"loop": loop, "reason": reason})
        total += v or 0.0
    return total


def lookup_matches(srv: RunningServer, toks: list[int]) -> bool:
    hashes, counts = fingerprint.chain(toks, 16)
    resp = srv.stub().LookupRoute(pb.LookupRouteRequest(
        model_id=MODEL, tenant_id=TENANT, hash_scheme=SCHEME, block_hashes=hashes,
        block_token_counts=counts), timeout=10)
    return bool(resp.reason_code == "PREFIX_MATCH")


@pytest.fixture
def srv() -> Iterator[RunningServer]:
    with running_server(config=CONFIG, grpc_workers=8) as s:
        yield s


UNARY = ["LookupRoute", "LookupPDRoute", "GetCacheState", "PublishEvent", "RenderTemplate"]


def test_worst_requests_to_every_method_are_answered_and_the_server_goes_on(
    srv: RunningServer,
) -> None:
    shapes = worst_protobuf()
    seen: dict[str, set[str]] = {}
    for method in UNARY:
        call = raw_unary(srv, method)
        for name, body in shapes.items():
            try:
                call(body, timeout=60)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            seen.setdefault(method, set()).add(code)
            if method in ("LookupRoute", "LookupPDRoute"):
                assert code == "OK", (method, name)  # fail-open, always
            else:
                assert code in ("OK", "INVALID_ARGUMENT"), (method, name, code)
    stream = srv.channel().stream_unary(f"/{SERVICE}/ReportCacheState")
    for name, body in shapes.items():
        try:
            stream(iter([body]), timeout=60)
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        assert code in ("OK", "INVALID_ARGUMENT"), (name, code)
    # one message over the transport bound: refused by grpc before any handler runs
    with pytest.raises(grpc.RpcError) as big:
        raw_unary(srv, "LookupRoute")(b"\x0a\x01m" + tag(999, 2) + varint.encode(MAX_MESSAGE)
                                      + b"\x00" * MAX_MESSAGE, timeout=60)
    assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "INVALID_ARGUMENT" in seen["PublishEvent"]
    # every shape was decided by the parsers (undecodable or valid), none raised in a handler
    for method in [*UNARY, "ReportCacheState"]:
        assert server_drops(srv, method) == 0, method
    undecodable = srv.metrics.registry.get_sample_value(
        "inferencecache_server_undecodable_requests_total", {"method": "LookupRoute"})
    assert undecodable is not None and undecodable >= 10
    srv.stub().ReportCacheState(iter([update("r1", [chain_entry(tokens(32))])]), timeout=10)
    assert lookup_matches(srv, tokens(32))


def test_a_handler_bug_drops_one_request_and_is_counted(srv: RunningServer) -> None:
    """Faults injected into the index calls: GetCacheState answers INTERNAL, LookupRoute fails
    open, a stream skips the one update; each counted under its method and reason."""
    backend: Any = srv.backend
    real_cache_state, real_lookup, real_apply = (
        backend.cache_state, backend.lookup, backend.apply_update)

    def bad_cache_state(tenant: str, model: str) -> Any:
        if tenant == "boom":
            raise RecursionError("maximum recursion depth exceeded")
        return real_cache_state(tenant, model)

    def bad_lookup(request: Any) -> Any:
        if request.tenant_id == "boom":
            raise MemoryError
        return real_lookup(request)

    def bad_apply(u: Any) -> None:
        if u.replica_id == "boom":
            raise KeyError("x")
        real_apply(u)

    backend.cache_state, backend.lookup, backend.apply_update = (
        bad_cache_state, bad_lookup, bad_apply)
    stub = srv.stub()
    with pytest.raises(grpc.RpcError) as e:
        stub.GetCacheState(pb.GetCacheStateRequest(tenant_id="boom", model_id="m"), timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "request dropped (nesting)" in (e.value.details() or "")
    assert server_drops(srv, "GetCacheState") == 1
    stub.GetCacheState(pb.GetCacheStateRequest(tenant_id="t", model_id="m"), timeout=10)

    resp = stub.LookupRoute(pb.LookupRouteRequest(tenant_id="boom", model_id="m",
                                                  hash_scheme="vllm", block_hashes=[b"x" * 8],
                                                  block_token_counts=[16]), timeout=10)
    assert resp.reason_code == "NO_HINT"
    assert srv.metrics.registry.get_sample_value(
        "inferencecache_server_dropped_inputs_total",
        {"loop": "LookupRoute", "reason": "memory"}) == 1

    ack = stub.ReportCacheState(iter([update("boom", [chain_entry(tokens(16))]),
                                      update("r1", [chain_entry(tokens(48))])]), timeout=10)
    assert ack.accepted
    assert srv.metrics.registry.get_sample_value(
        "inferencecache_server_dropped_inputs_total",
        {"loop": "ReportCacheState", "reason": "lookup"}) == 1
    assert lookup_matches(srv, tokens(48))


def http(url: str, method: str = "GET", body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_worst_admin_bodies_are_400_and_a_snapshot_bug_is_a_counted_500(
    srv: RunningServer,
) -> None:
    bodies = {
        "deep_array": b"[" * 100_000,
        "deep_object": b'{"a":' * 100_000,
        "deep_valid": b"[" * 5_000 + b"]" * 5_000,
        "invalid_utf8": b'{"version": 5, "policies": [{"namespace": "\xff\xfe"}]}',
        "huge_int": b'{"version": 1' + b"0" * 100_000 + b"}",
        "million_items": b'{"version": 5, "policies": [' + b"0," * 400_000 + b"0]}",
        "nan": b'{"version": NaN}',
    }
    for path in ("/policy", "/probe"):
        for name, body in bodies.items():
            status, _ = http(srv.admin_url + path, "POST", body)
            assert status == 400, (path, name, status)
    assert server_drops(srv, "http") == 0
    backend: Any = srv.backend
    real = backend.snapshot_json
    backend.snapshot_json = lambda: (_ for _ in ()).throw(UnicodeError("bad"))
    status, text = http(srv.admin_url + "/snapshot")
    assert status == 500 and b"request dropped" in text
    assert srv.metrics.registry.get_sample_value(
        "inferencecache_server_dropped_inputs_total", {"loop": "http", "reason": "unicode"}) == 1
    backend.snapshot_json = real
    assert http(srv.admin_url + "/snapshot")[0] == 200
    assert http(srv.http_url + "/healthz") == (200, b"ok\n")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_sweeper_survives_a_failing_sweep_and_healthz_reports_a_dead_sweeper() -> None:
    with running_server(config=CONFIG, sweep_interval=0.01) as s:
        backend: Any = s.backend
        real = backend.sweep
        state = {"n": 0}

        def sweep() -> None:
            state["n"] += 1
            if state["n"] == 2:
                raise OverflowError("bad clock")
            if state["n"] == 5:
                raise SystemExit  # not an Exception: ends the thread, as a fatal error would
            real()

        backend.sweep = sweep
        wait_for(lambda: state["n"] >= 5)
        assert s.metrics.registry.get_sample_value(
            "inferencecache_server_sweeps_total", {"result": "error"}) == 1
        assert (s.metrics.registry.get_sample_value(
            "inferencecache_server_sweeps_total", {"result": "ok"}) or 0) >= 2
        wait_for(lambda: not any(t.name == "sweeper" for t in threading.enumerate()))
        status, text = http(s.http_url + "/healthz")
        assert status == 503 and b"sweeper" in text
