"""The InferenceCache service end to end on a real in-process gRPC server (loopback)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inferencecache import fingerprint, varint
from inferencecache.index.clock import SystemClock
from inferencecache.index.model import PROBE_TENANT
from inferencecache.index.tenant_config import IndexConfig, TenantPolicy
from inferencecache.server.settings import MAX_RECEIVE_MESSAGE_BYTES
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.tokenize import load_tokenizer_dir
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.server.helpers import (
    CONFIG,
    MODEL,
    PERMISSIVE,
    SCHEME,
    TENANT,
    chain_entry,
    lookup_chain,
    lookup_tokens,
    one_shot,
    tokens,
    update,
    wait_for,
)
from tests.tokenize.tinytok import write_model

SERVICE = "inferencecache.v1alpha1.InferenceCache"
LOOKUP_PATH = f"/{SERVICE}/LookupRoute"


@pytest.fixture
def srv() -> Iterator[RunningServer]:
    with running_server(config=CONFIG) as s:
        yield s


def calls(s: RunningServer, model: str, reason: str, hint: bool) -> float:
    v = s.metrics.registry.get_sample_value(
        "inferencecache_lookup_route_calls_total",
        {"model": model, "reason_code": reason, "hint_used": "true" if hint else "false"},
    )
    return v or 0.0


def total_calls(s: RunningServer) -> float:
    total = 0.0
    for metric in s.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "inferencecache_lookup_route_calls_total":
                total += sample.value
    return total


def raw_lookup(s: RunningServer) -> grpc.UnaryUnaryMultiCallable:
    return s.channel().unary_unary(
        LOOKUP_PATH, response_deserializer=pb.LookupRouteResponse.FromString
    )


# -- wire: stubs, streams, health, reflection ------------------------------------------------


def test_c10_02_template_and_pd_route_without_configuration(srv: RunningServer) -> None:
    stub = srv.stub()
    rt = stub.RenderTemplate(pb.RenderTemplateRequest(template_ref="x", tenant_id=TENANT))
    assert rt == pb.RenderTemplateResponse(
        reason_code="TEMPLATE_NOT_FOUND", tenant_namespace=TENANT.encode()
    )
    pd = stub.LookupPDRoute(pb.LookupPDRouteRequest(model_id=MODEL, tenant_id=TENANT))
    assert pd == pb.LookupPDRouteResponse(reason_code="UNKNOWN_TOPOLOGY")


def test_c10_03_health_check_empty_service_is_serving(srv: RunningServer) -> None:
    health = health_pb2_grpc.HealthStub(srv.channel())  # type: ignore[no-untyped-call]
    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_c10_91_health_check_other_service_not_found(srv: RunningServer) -> None:
    health = health_pb2_grpc.HealthStub(srv.channel())  # type: ignore[no-untyped-call]
    for name in (SERVICE, "grpc.health.v1.Health", "nope"):
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def _reflect(s: RunningServer, req: reflection_pb2.ServerReflectionRequest) -> Any:
    stub = reflection_pb2_grpc.ServerReflectionStub(s.channel())  # type: ignore[no-untyped-call]
    responses = list(stub.ServerReflectionInfo(iter([req]), timeout=10))
    assert len(responses) == 1
    return responses[0]


def test_c10_91_reflection_lists_services(srv: RunningServer) -> None:
    resp = _reflect(srv, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in resp.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize(
    ("symbol", "filename"),
    [
        (SERVICE, "inferencecache/v1alpha1/inferencecache.proto"),
        ("grpc.health.v1.Health", "grpc_health/v1/health.proto"),
    ],
)
def test_c10_91_reflection_serves_the_file(srv: RunningServer, symbol: str, filename: str) -> None:
    resp = _reflect(srv, reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol))
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in resp.file_descriptor_response.file_descriptor_proto
    ]
    assert files and files[0].name == filename
    if symbol == SERVICE:
        assert files[0].package == "inferencecache.v1alpha1"
        methods = [m.name for m in files[0].service[0].method]
        assert len(methods) == 8 and "LookupRoute" in methods


# -- ingest streams (contract-and-index.md §4.1) ---------------------------------------------------


def test_c10_05_empty_report_stream_is_acked(srv: RunningServer) -> None:
    ack = srv.stub().ReportCacheState(iter([]), timeout=10)
    assert ack == pb.Ack(accepted=True, reason_code="")


class _Feeder:
    """A request iterator fed from the test thread (None ends the stream)."""

    def __init__(self) -> None:
        self.q: queue.Queue[pb.CacheStateUpdate | None] = queue.Queue()

    def __iter__(self) -> Iterator[pb.CacheStateUpdate]:
        while True:
            item = self.q.get()
            if item is None:
                return
            yield item


def _matches(stub: object, req: pb.LookupRouteRequest) -> bool:
    resp = stub.LookupRoute(req, timeout=10)  # type: ignore[attr-defined]
    return resp.reason_code == "PREFIX_MATCH"  # type: ignore[no-any-return]


def test_c10_06_update_visible_before_stream_closes(srv: RunningServer) -> None:
    stub = srv.stub()
    feeder = _Feeder()
    fut = stub.ReportCacheState.future(iter(feeder), timeout=30)
    try:
        feeder.q.put(update("r1", [chain_entry(tokens(64))]))
        wait_for(lambda: _matches(stub, lookup_chain(tokens(64))))
        assert not fut.done()  # the stream is still open
    finally:
        feeder.q.put(None)
    assert fut.result(timeout=10) == pb.Ack(accepted=True)
    assert not srv.metrics.registry.get_sample_value(
        "inferencecache_server_report_stream_errors_total", {"reason": "cancelled"}
    )  # a normal half-close is not a cancel


def test_c10_07_cancelled_stream_is_an_error_and_keeps_earlier_updates(srv: RunningServer) -> None:
    stub = srv.stub()
    feeder = _Feeder()
    fut = stub.ReportCacheState.future(iter(feeder), timeout=30)
    try:
        feeder.q.put(update("r1", [chain_entry(tokens(64))]))
        wait_for(lambda: _matches(stub, lookup_chain(tokens(64))))
        assert fut.cancel()
        assert fut.code() == grpc.StatusCode.CANCELLED
        wait_for(
            lambda: srv.metrics.registry.get_sample_value(
                "inferencecache_server_report_stream_errors_total", {"reason": "cancelled"}
            )
        )
    finally:
        feeder.q.put(None)
    assert _matches(stub, lookup_chain(tokens(64)))


def test_bad_input_undecodable_update_ends_stream_invalid_argument(srv: RunningServer) -> None:
    """A message protobuf cannot decode: INVALID_ARGUMENT; the updates before it stay applied."""
    call = srv.channel().stream_unary(
        f"/{SERVICE}/ReportCacheState", response_deserializer=pb.Ack.FromString
    )
    good = update("r1", [chain_entry(tokens(32))]).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        call(iter([good, b"\x0a\x05ab"]), timeout=10)  # truncated string field
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _matches(srv.stub(), lookup_chain(tokens(32)))


def test_bad_input_undecodable_event_is_invalid_argument(srv: RunningServer) -> None:
    call = srv.channel().unary_unary(
        f"/{SERVICE}/PublishEvent", response_deserializer=pb.Ack.FromString
    )
    with pytest.raises(grpc.RpcError) as e:
        call(b"\x12\x02\xff\xfe", timeout=10)  # replica_id with invalid UTF-8
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- lookups ------------------------------------------------------------------------------------


def test_report_then_lookup_chain_tokens_and_exact(srv: RunningServer) -> None:
    stub = srv.stub()
    toks = tokens(64)
    legacy = pb.PrefixEntry(prefix_hash=b"legacy-blob", token_count=128)
    ack = stub.ReportCacheState(one_shot(update("r1", [chain_entry(toks), legacy])), timeout=10)
    assert ack.accepted
    by_chain = stub.LookupRoute(lookup_chain(toks), timeout=10)
    assert by_chain.reason_code == "PREFIX_MATCH"
    assert [(s.replica_id, s.matched_tokens, s.tier) for s in by_chain.replica_scores] == [
        ("r1", 64, pb.CACHE_TIER_T1)
    ]
    # contract-and-index.md §10 item 64: token_ids give the same outcome as the equivalent chain,
    # without echo
    by_tokens = stub.LookupRoute(lookup_tokens(toks), timeout=10)
    assert by_tokens.reason_code == "PREFIX_MATCH"
    assert [s.matched_tokens for s in by_tokens.replica_scores] == [64]
    assert list(by_tokens.token_ids) == []
    # contract-and-index.md §10 item 8: legacy exact lookup returns the stored count
    exact = stub.LookupRoute(
        pb.LookupRouteRequest(
            tenant_id=TENANT, model_id=MODEL, hash_scheme=SCHEME, prefix_hash=b"legacy-blob"
        ),
        timeout=10,
    )
    assert exact.reason_code == "PREFIX_MATCH"
    assert exact.replica_scores[0].matched_tokens == 128


def test_long_inputs_take_the_fast_path_and_match(srv: RunningServer) -> None:
    """512-block chains and 8192 token ids (the benchmark shapes) answer PREFIX_MATCH."""
    stub = srv.stub()
    toks = tokens(8192, start=1000)
    stub.ReportCacheState(one_shot(update("r1", [chain_entry(toks)])), timeout=10)
    by_chain = stub.LookupRoute(lookup_chain(toks), timeout=10)
    by_tokens = stub.LookupRoute(lookup_tokens(toks), timeout=10)
    for resp in (by_chain, by_tokens):
        assert resp.reason_code == "PREFIX_MATCH"
        assert resp.replica_scores[0].matched_tokens == 8192


def test_publish_event_evicts(srv: RunningServer) -> None:
    stub = srv.stub()
    toks = tokens(32)
    stub.ReportCacheState(one_shot(update("r1", [chain_entry(toks)])), timeout=10)
    hashes, _ = fingerprint.chain(toks, 16)
    ack = stub.PublishEvent(
        pb.CacheEvent(
            type=pb.CacheEvent.PREFIX_EVICTED,
            replica_id="r1",
            model_id=MODEL,
            tenant_id=TENANT,
            prefix_hash=hashes[0],
        ),
        timeout=10,
    )
    assert ack == pb.Ack(accepted=True)
    assert stub.LookupRoute(lookup_chain(toks), timeout=10).reason_code == "NO_HINT"


def test_c10_26_probe_tenant_lookup(srv: RunningServer) -> None:
    stub = srv.stub()
    before = calls(srv, MODEL, "NO_HINT", False)
    resp = stub.LookupRoute(lookup_chain(tokens(32), tenant=PROBE_TENANT), timeout=10)
    assert resp == pb.LookupRouteResponse(reason_code="NO_HINT", lookup_latency_us=0)
    assert calls(srv, MODEL, "NO_HINT", False) == before + 1


def test_c10_75_exactly_one_counter_increment_per_call(srv: RunningServer) -> None:
    stub = srv.stub()
    stub.ReportCacheState(one_shot(update("r1", [chain_entry(tokens(64))])), timeout=10)
    requests = [
        lookup_chain(tokens(64)),  # PREFIX_MATCH
        lookup_chain(tokens(64, start=5000)),  # novel prefix -> NO_HINT (affinity off)
        lookup_chain(tokens(64), tenant="other"),  # UNKNOWN_TENANT
        lookup_chain(tokens(64), model="other"),  # UNKNOWN_MODEL
        lookup_chain(tokens(64), scheme="sglang"),  # UNKNOWN_HASH_SCHEME
        pb.LookupRouteRequest(),  # empty key -> NO_HINT
    ]
    before = total_calls(srv)
    reasons = [stub.LookupRoute(r, timeout=10).reason_code for r in requests]
    assert reasons == [
        "PREFIX_MATCH",
        "NO_HINT",
        "UNKNOWN_TENANT",
        "UNKNOWN_MODEL",
        "UNKNOWN_HASH_SCHEME",
        "NO_HINT",
    ]
    assert total_calls(srv) == before + len(requests)
    assert calls(srv, MODEL, "PREFIX_MATCH", True) == 1
    assert calls(srv, MODEL, "UNKNOWN_HASH_SCHEME", False) == 1
    assert calls(srv, "other", "UNKNOWN_MODEL", False) == 1
    latency = srv.metrics.registry.get_sample_value(
        "inferencecache_lookup_route_latency_seconds_count", {"model": MODEL}
    )
    assert latency is not None and latency >= 4


def test_c10_56_affinity_hint_counts_as_hint_used() -> None:
    config = IndexConfig(policies={TENANT: TenantPolicy()})  # defaults: affinity on
    with running_server(config=config) as s:
        stub = s.stub()
        stub.ReportCacheState(one_shot(update("r1", [chain_entry(tokens(64))])), timeout=10)
        resp = stub.LookupRoute(lookup_chain(tokens(64, start=9000)), timeout=10)
        assert resp.reason_code == "AFFINITY_HINT"
        assert [s.replica_id for s in resp.replica_scores] == ["r1"]
        assert calls(s, MODEL, "AFFINITY_HINT", True) == 1


def test_c10_90_int32_wrap_fails_open_with_ok(srv: RunningServer) -> None:
    stub = srv.stub()
    toks = tokens(32)
    stub.ReportCacheState(one_shot(update("r1", [chain_entry(toks)])), timeout=10)
    hashes, _ = fingerprint.chain(toks, 16)
    req = pb.LookupRouteRequest(
        tenant_id=TENANT,
        model_id=MODEL,
        hash_scheme=SCHEME,
        block_hashes=hashes,
        block_token_counts=[2147483647, 2147483647],
    )
    assert stub.LookupRoute(req, timeout=10).reason_code == "NO_HINT"


def _bad_lookups() -> list[bytes]:
    reqs = [
        pb.LookupRouteRequest(),
        pb.LookupRouteRequest(
            tenant_id=TENANT,
            model_id=MODEL,
            hash_scheme=SCHEME,
            block_hashes=[b"x" * 8] * 3,
            block_token_counts=[16],
        ),
        pb.LookupRouteRequest(
            tenant_id=TENANT,
            model_id=MODEL,
            hash_scheme=SCHEME,
            block_hashes=[b"y" * 8] * 2,
            block_token_counts=[-16, -(2**31)],
        ),
        pb.LookupRouteRequest(
            tenant_id=TENANT,
            model_id=MODEL,
            hash_scheme=SCHEME,
            prefix_hash=b"z" * 100_000,
            prefix_token_count=-(2**31),
            slo=pb.SLO(ttft_ms=-5, tbt_ms=2**31 - 1),
        ),
        pb.LookupRouteRequest(
            tenant_id=TENANT,
            model_id=MODEL,
            hash_scheme=SCHEME,
            block_hashes=[i.to_bytes(8, "big") for i in range(70_000)],
            block_token_counts=[16] * 70_000,
        ),
        pb.LookupRouteRequest(
            tenant_id=TENANT, model_id=MODEL, hash_scheme=SCHEME, token_ids=[2**32 - 1] * 40
        ),
        pb.LookupRouteRequest(
            tenant_id=TENANT, model_id=MODEL, hash_scheme=SCHEME, prompt_text="no tokenizer"
        ),
        pb.LookupRouteRequest(tenant_id="\u0000\uffff", model_id="🙂" * 1000, hash_scheme=SCHEME),
    ]
    raw = [r.SerializeToString() for r in reqs]
    # 1,048,577 token ids (one over the bound) as packed varints
    payload = b"\x01" * 1_048_577
    length = varint.encode(len(payload))
    raw.append(b"\x0a\x01m\x12\x01t\x2a\x04vllm" + b"\x4a" + length + payload)
    # undecodable: invalid UTF-8, truncated field, garbage, group wire type, a >u32 token varint
    raw += [
        b"\x0a\x02\xff\xfe",
        b"\x12\x10short",
        bytes(range(256)),
        b"\x0b\x0c",
        b"\x0a\x01m\x12\x01t\x2a\x04vllm\x4a\x05\xff\xff\xff\xff\x7f",
    ]
    return raw


def _decodable(body: bytes) -> bool:
    try:
        pb.LookupRouteRequest.FromString(body)
    except Exception:
        return False
    return True


def test_c10_04_bad_input_every_lookup_is_ok_and_fails_open(srv: RunningServer) -> None:
    """Nonsense values, over-bound inputs and undecodable bytes: status OK, fail-open answer."""
    srv.stub().ReportCacheState(one_shot(update("r1", [chain_entry(tokens(64))])), timeout=10)
    call = raw_lookup(srv)
    before = total_calls(srv)
    bad = _bad_lookups()
    for body in bad:
        resp, rpc = call.with_call(body, timeout=30)
        assert rpc.code() == grpc.StatusCode.OK
        assert resp.reason_code in ("NO_HINT", "UNKNOWN_TENANT"), body[:40]
        assert list(resp.replica_scores) == []
    assert total_calls(srv) == before + len(bad)
    undecodable = srv.metrics.registry.get_sample_value(
        "inferencecache_server_undecodable_requests_total", {"method": "LookupRoute"}
    )
    assert undecodable == sum(1 for body in bad if not _decodable(body))
    assert undecodable >= 3
    # the server is still fine
    assert _matches(srv.stub(), lookup_chain(tokens(64)))


def test_c10_83_get_cache_state(srv: RunningServer) -> None:
    stub = srv.stub()
    stats = {
        "r2": pb.ReplicaStats(
            replica_id="ignored",
            hit_rate=0.5,
            pressure=0.25,
            cache_memory_bytes=7,
            t2_hit_tokens=3,
            t2_query_tokens=4,
            client_version="v9",
        ),
        "r1": pb.ReplicaStats(hit_rate=0.75),
    }
    msgs = [
        update("r2", [chain_entry(tokens(32))], stats=stats["r2"]),
        update("r1", [chain_entry(tokens(16, 900))], scheme="sglang", stats=stats["r1"]),
    ]
    stub.ReportCacheState(iter(msgs), timeout=10)
    resp = stub.GetCacheState(pb.GetCacheStateRequest(model_id=MODEL, tenant_id=TENANT), timeout=10)
    assert [r.replica_id for r in resp.replicas] == ["r1", "r2"]
    r2 = resp.replicas[1]
    assert (
        r2.hit_rate,
        r2.pressure,
        r2.cache_memory_bytes,
        r2.t2_hit_tokens,
        r2.t2_query_tokens,
    ) == (0.5, 0.25, 7, 3, 4)
    assert r2.client_version == ""
    assert resp.summary.total_prefixes == 3 and resp.summary.hot_prefixes == 0
    probe = stub.GetCacheState(
        pb.GetCacheStateRequest(model_id=MODEL, tenant_id=PROBE_TENANT), timeout=10
    )
    assert list(probe.replicas) == [] and probe.summary.total_prefixes == 0
    assert probe.HasField("summary")


def test_c10_84_index_entries_gauge(srv: RunningServer) -> None:
    stub = srv.stub()
    stub.ReportCacheState(one_shot(update("r1", [chain_entry(tokens(48))])), timeout=10)

    def gauge() -> float | None:
        return srv.metrics.registry.get_sample_value(
            "inferencecache_index_entries", {"model": MODEL}
        )

    assert gauge() == 3
    stub.PublishEvent(
        pb.CacheEvent(
            type=pb.CacheEvent.ALL_CLEARED, replica_id="r1", model_id=MODEL, tenant_id=TENANT
        ),
        timeout=10,
    )
    assert gauge() == 0


def test_c10_67_prompt_text_is_tokenized_and_echoed(tmp_path: Path) -> None:
    write_model(tmp_path, "org/tiny")
    tokenizers = load_tokenizer_dir(tmp_path)
    text = "the quick brown fox jumps over the lazy dog " * 6
    toks = tokenizers.encode_chat("org/tiny", text)
    assert len(toks) >= 32
    config = IndexConfig(policies={TENANT: PERMISSIVE})
    with running_server(config=config, tokenizer=tokenizers) as s:
        stub = s.stub()
        stub.ReportCacheState(
            one_shot(update("r1", [chain_entry(toks)], model="org/tiny")), timeout=10
        )
        req = pb.LookupRouteRequest(
            tenant_id=TENANT, model_id="org/tiny", hash_scheme=SCHEME, prompt_text=text
        )
        resp = stub.LookupRoute(req, timeout=10)
        assert resp.reason_code == "PREFIX_MATCH"
        assert list(resp.token_ids) == toks
        assert resp.replica_scores[0].matched_tokens == len(toks) // 16 * 16
        unknown = stub.LookupRoute(
            pb.LookupRouteRequest(
                tenant_id=TENANT, model_id="nope", hash_scheme=SCHEME, prompt_text=text
            ),
            timeout=10,
        )
        assert unknown.reason_code == "NO_HINT" and list(unknown.token_ids) == []


def test_concurrent_ingest_and_lookups_stay_ok(srv: RunningServer) -> None:
    """Lookups from many threads while streams ingest: every call OK, no server error."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def ingest(replica: str) -> None:
        stub = srv.stub()
        try:
            for i in range(30):
                stub.ReportCacheState(
                    one_shot(update(replica, [chain_entry(tokens(64, start=i * 64))])), timeout=10
                )
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def look() -> None:
        stub = srv.stub()
        try:
            while not stop.is_set():
                resp = stub.LookupRoute(lookup_chain(tokens(64)), timeout=10)
                assert resp.reason_code in ("PREFIX_MATCH", "NO_HINT", "UNKNOWN_TENANT")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    writers = [threading.Thread(target=ingest, args=(f"r{i}",)) for i in range(3)]
    readers = [threading.Thread(target=look) for _ in range(4)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(60)
    stop.set()
    for t in readers:
        t.join(60)
    assert not errors
    resp = srv.stub().LookupRoute(lookup_chain(tokens(64)), timeout=10)
    assert {s.replica_id for s in resp.replica_scores} == {"r0", "r1", "r2"}


def test_bad_input_index_exception_still_fails_open(
    srv: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug below the service (here: the router raising) is a NO_HINT with status OK."""

    def boom(req: object) -> object:
        raise RuntimeError("index bug")

    monkeypatch.setattr(srv.backend.router, "lookup", boom)
    before = total_calls(srv)
    resp = srv.stub().LookupRoute(lookup_chain(tokens(32)), timeout=10)
    assert resp.reason_code == "NO_HINT" and list(resp.replica_scores) == []
    assert total_calls(srv) == before + 1
    errors = srv.metrics.registry.get_sample_value("inferencecache_server_lookup_errors_total")
    assert errors == 1


def dropped(s: RunningServer, reason: str) -> float:
    v = s.metrics.registry.get_sample_value(
        "inferencecache_ingest_dropped_total", {"reason": reason}
    )
    return v or 0.0


def test_bad_input_nonsense_ingest_is_acked_dropped_and_counted(srv: RunningServer) -> None:
    """Decodable nonsense never fails an ingest RPC: entries are dropped (and counted) or stored
    as given; the server keeps serving."""
    stub = srv.stub()
    nan = float("nan")
    msgs = [
        update("r1", [pb.PrefixEntry(block_hashes=[b"a" * 8] * 3, block_token_counts=[16])]),
        update("r1", [chain_entry(tokens(32))], scheme=""),
        update("r1", [pb.PrefixEntry(prefix_hash=b"h" * 1000, token_count=5)]),
        update(
            "r1",
            [
                pb.PrefixEntry(
                    block_hashes=[i.to_bytes(8, "big") for i in range(70_000)],
                    block_token_counts=[16] * 70_000,
                )
            ],
        ),
        update(
            "r2",
            [
                pb.PrefixEntry(prefix_hash=b"n", token_count=-(2**31), tier=-1),  # type: ignore[arg-type]
                pb.PrefixEntry(prefix_hash=b"o", token_count=2**31 - 1, tier=99),  # type: ignore[arg-type]
            ],
            stats=pb.ReplicaStats(hit_rate=nan, pressure=float("inf"), cache_memory_bytes=-1),
            timestamp_us=-(2**63),
        ),
    ]
    ack = stub.ReportCacheState(iter(msgs), timeout=30)
    assert ack == pb.Ack(accepted=True)
    assert dropped(srv, "chain_length_mismatch") == 1
    assert dropped(srv, "empty_hash_scheme") == 1
    assert dropped(srv, "hash_too_long") == 1
    assert dropped(srv, "chain_too_long") == 1
    for event_type in (0, 1, 2, 3, 4, 99):
        ack = stub.PublishEvent(
            pb.CacheEvent(
                type=event_type,  # type: ignore[arg-type]
                replica_id="r2",
                model_id=MODEL,
                tenant_id=TENANT,
                prefix_hash=b"\xff" * 300,
                timestamp_us=2**63 - 1,
            ),
            timeout=10,
        )
        assert ack == pb.Ack(accepted=True)
    state = stub.GetCacheState(
        pb.GetCacheStateRequest(model_id=MODEL, tenant_id=TENANT), timeout=10
    )
    assert state.summary.total_prefixes >= 0
    stub.ReportCacheState(one_shot(update("r3", [chain_entry(tokens(64))])), timeout=10)
    assert _matches(stub, lookup_chain(tokens(64)))


def test_bad_input_ingest_exception_skips_only_that_message(
    srv: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An update the index raises on is skipped and counted; the stream and later updates go on."""
    real = srv.backend.index.apply_update

    def flaky(upd: Any) -> None:
        if upd.replica_id == "poison":
            raise RuntimeError("index bug")
        real(upd)

    monkeypatch.setattr(srv.backend.index, "apply_update", flaky)
    msgs = [update("poison", [chain_entry(tokens(32))]), update("r1", [chain_entry(tokens(32))])]
    assert srv.stub().ReportCacheState(iter(msgs), timeout=10) == pb.Ack(accepted=True)
    errors = srv.metrics.registry.get_sample_value(
        "inferencecache_server_ingest_errors_total", {"kind": "update"}
    )
    assert errors == 1
    resp = srv.stub().LookupRoute(lookup_chain(tokens(32)), timeout=10)
    assert [s.replica_id for s in resp.replica_scores] == ["r1"]


# -- c10 item 72 through the real clock ------------------------------------------------------


class HungTokenizer:
    """A ``PromptTokenizer`` whose ``encode_chat`` blocks until ``release`` is set (bounded by
    ``hold`` seconds), then returns one id per character."""

    def __init__(self, hold: float = 30.0) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hold = hold
        self.calls = 0

    def has_model(self, model_id: str) -> bool:
        return model_id == MODEL

    def encode_chat(self, model_id: str, text: str) -> list[int]:
        self.calls += 1
        self.entered.set()
        self.release.wait(self.hold)
        return [ord(c) for c in text]


def test_c10_72_hung_tokenizer_times_out_after_5s_on_the_real_clock() -> None:
    """No caller deadline, no policy timeout, ``SystemClock``: the server's own 5 s prompt
    deadline ends the lookup with TIMEOUT (not earlier, not never); a tokenizer that answers
    within the 5 s is waited for."""
    tok = HungTokenizer()
    text = "x" * 16
    try:
        with running_server(config=CONFIG, tokenizer=tok) as s:
            assert type(s.backend.clock) is SystemClock
            assert s.backend.index.policy(TENANT).lookup_timeout_ms == 0
            stub = s.stub()
            req = pb.LookupRouteRequest(
                tenant_id=TENANT, model_id=MODEL, hash_scheme=SCHEME, prompt_text=text,
                adapter_id="a",
            )
            t0 = time.monotonic()
            fut = stub.LookupRoute.future(req)  # no gRPC deadline: "no other deadline"
            try:
                resp = fut.result(timeout=20)  # the test's own bound, not the caller's deadline
            finally:
                fut.cancel()
            elapsed = time.monotonic() - t0
            assert tok.entered.is_set() and tok.calls == 1
            assert (resp.reason_code, list(resp.token_ids), resp.adapter_id) == ("TIMEOUT", [], "")
            assert list(resp.replica_scores) == []
            assert 5.0 <= elapsed < 8.0, elapsed
            assert 5_000_000 <= resp.lookup_latency_us < 7_000_000, resp.lookup_latency_us
            assert calls(s, MODEL, "TIMEOUT", False) == 1

            # a tokenizer that answers within the 5 s is waited for: its chain matches
            hung, tok.release = tok.release, threading.Event()
            hung.set()  # free the abandoned call
            tok.hold = 0.5  # the next call answers after 0.5 s
            stub.ReportCacheState(
                one_shot(update("r1", [chain_entry([ord(c) for c in text], adapter="a")])),
                timeout=10,
            )
            t0 = time.monotonic()
            resp = stub.LookupRoute.future(req).result(timeout=20)
            elapsed = time.monotonic() - t0
            assert (resp.reason_code, resp.adapter_id) == ("PREFIX_MATCH", "a"), resp
            assert list(resp.token_ids) == [ord(c) for c in text]
            assert 0.5 <= elapsed < 5.0, elapsed
            assert tok.calls == 2
    finally:
        tok.release.set()  # never leave a tokenizer thread behind


# -- transport bound: the gRPC max receive message size ---------------------------------------


def _lookup_of_size(size: int) -> pb.LookupRouteRequest:
    """A LookupRoute request whose serialized form is exactly ``size`` bytes (prompt_text
    padding; no tokenizer, so it is answered NO_HINT when it gets through)."""
    req = pb.LookupRouteRequest(tenant_id=TENANT, model_id=MODEL, hash_scheme=SCHEME)
    n = size - req.ByteSize()
    while True:  # the length varint of prompt_text grows with it
        req.prompt_text = "x" * n
        over = req.ByteSize() - size
        if over == 0:
            return req
        n -= over


def test_lookup_above_the_max_receive_size_is_resource_exhausted_by_the_transport() -> None:
    """docs/server.md "Bounds": a LookupRoute request larger than the server's gRPC max receive
    message size (16 MiB) is rejected by grpc core with RESOURCE_EXHAUSTED before our
    deserializer or handler runs (no call counted, nothing undecodable); one of exactly the
    limit is answered normally."""
    assert MAX_RECEIVE_MESSAGE_BYTES == 16 * 1024 * 1024
    big = _lookup_of_size(MAX_RECEIVE_MESSAGE_BYTES + 1)
    fits = _lookup_of_size(MAX_RECEIVE_MESSAGE_BYTES)
    assert (big.ByteSize(), fits.ByteSize()) == (
        MAX_RECEIVE_MESSAGE_BYTES + 1, MAX_RECEIVE_MESSAGE_BYTES)
    with running_server(config=CONFIG) as s:
        ch = grpc.insecure_channel(
            s.grpc_target, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)]
        )
        s.channels.append(ch)
        stub = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as err:
            stub.LookupRoute(big, timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        # grpc core's own message, from the server side: "SERVER: Received message larger
        # than max (16777217 vs. 16777216)"
        details = err.value.details() or ""
        assert "larger than max" in details and str(MAX_RECEIVE_MESSAGE_BYTES + 1) in details
        assert total_calls(s) == 0  # our handler never ran
        undecodable = s.metrics.registry.get_sample_value(
            "inferencecache_server_undecodable_requests_total", {"method": "LookupRoute"}
        )
        assert not undecodable
        # the same channel still works, and a request of exactly the limit gets through
        resp = stub.LookupRoute(fits, timeout=30)
        assert (resp.reason_code, list(resp.token_ids)) == ("NO_HINT", [])
        assert calls(s, MODEL, "NO_HINT", False) == 1 and total_calls(s) == 1
