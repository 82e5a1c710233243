"""Read everything ``doctor`` was pointed at (each request bounded, none raising).

The engine's KV events are sampled on a thread while the HTTP and gRPC reads run, so a run
takes about ``--events-wait`` plus one round of requests.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferencecache.channels import ChannelSecurity
from inferencecache.doctor.facts import (
    EngineFacts,
    EventSample,
    GatewayFacts,
    ServerFacts,
    SubscriberFacts,
    fetch,
    sample_events,
    scrape,
)
from inferencecache.doctor.settings import DoctorSettings

PROBE_BACKEND = "doctor"
"""The ``/probe`` backend name: its replica is ``__probe-doctor`` under the probe tenant."""


@dataclass
class Facts:
    settings: DoctorSettings
    server: ServerFacts
    subscribers: list[SubscriberFacts] = field(default_factory=list)
    gateways: list[GatewayFacts] = field(default_factory=list)
    engine: EngineFacts | None = None
    events: EventSample | None = None
    token_error: str = ""
    probe_model: str = ""
    probe_scheme: str = ""


def read_token(path: str) -> tuple[str | None, str]:
    """The admin token (one line, whitespace stripped), or the error text."""
    if not path:
        return None, ""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot read --admin-token-file {path!r}: {getattr(e, 'strerror', e)}"
    return (token, "") if token else (None, f"--admin-token-file {path!r} is empty")


def gather(s: DoctorSettings) -> Facts:
    with ThreadPoolExecutor(max_workers=1) as pool:
        events = (
            pool.submit(sample_events, s.engine_endpoint, s.replay_endpoint, s.events_wait)
            if s.engine_endpoint
            else None
        )
        facts = Facts(s, ServerFacts(str(s.server), s.server_http))
        for url in s.subscriber_urls:
            resp, metrics = scrape(url + "/metrics", s.timeout)
            sub = SubscriberFacts(url, resp, metrics)
            if resp.status is not None:
                sub.healthz = fetch(url + "/healthz", s.timeout)
            facts.subscribers.append(sub)
        for url in s.gateway_urls:
            resp, metrics = scrape(url + "/metrics", s.timeout)
            gw = GatewayFacts(url, resp, metrics)
            if resp.status is not None:
                gw.healthz = fetch(url + "/healthz", s.timeout)
            facts.gateways.append(gw)
        if s.engine_url:
            resp, metrics = scrape(s.engine_url + "/metrics", s.timeout)
            facts.engine = EngineFacts(s.engine_url, resp, metrics)
            facts.engine.models = fetch(s.engine_url + "/v1/models", s.timeout)
        infos = [sub.info for sub in facts.subscribers if sub.info]
        facts.probe_model = s.model_id or next(
            (i["model_id"] for i in infos if i.get("model_id")), "doctor"
        )
        facts.probe_scheme = s.hash_scheme or next(
            (i["hash_scheme"] for i in infos if i.get("hash_scheme")), "vllm"
        )
        token, facts.token_error = read_token(s.admin_token_file)
        _read_server(facts, token)
        if events is not None:
            facts.events = events.result()
    return facts


def _read_server(facts: Facts, token: str | None) -> None:
    s, sv = facts.settings, facts.server
    sv.healthz = fetch(s.server_http + "/healthz", s.timeout)
    if sv.http_up:
        sv.readyz = fetch(s.server_http + "/readyz", s.timeout)
        sv.metrics_resp, sv.metrics = scrape(s.server_http + "/metrics", s.timeout)
        sv.snapshot = fetch(s.admin_base + "/snapshot", s.timeout, token=token)
        body = json.dumps(
            {"backend": PROBE_BACKEND, "model": facts.probe_model,
             "hashScheme": facts.probe_scheme}
        ).encode()  # fmt: skip
        sv.probe = fetch(s.admin_base + "/probe", s.timeout, method="POST", body=body,
                         token=token)  # fmt: skip
    _read_grpc(facts)


def _read_grpc(facts: Facts) -> None:
    from inferencecache.index import PROBE_TENANT
    from inferencecache.v1alpha1 import inferencecache_pb2 as pb
    from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

    s, sv = facts.settings, facts.server
    security = ChannelSecurity.of(s)
    md = security.metadata()
    with security.channel(str(s.server)) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=s.timeout)
        except grpc.FutureTimeoutError:
            sv.grpc_error = f"no gRPC connection to {s.server} within {s.timeout:g}s"
            return
        try:
            health = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
            resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=s.timeout)
            sv.health = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as e:
            sv.health = f"error: {_rpc_error(e)}"
        stub = pb_grpc.InferenceCacheStub(channel)  # type: ignore[no-untyped-call]
        model, scheme = facts.probe_model, facts.probe_scheme
        update = pb.CacheStateUpdate(
            replica_id=f"__probe-{PROBE_BACKEND}", model_id=model, tenant_id=PROBE_TENANT,
            hash_scheme=scheme,
            prefixes=[pb.PrefixEntry(prefix_hash=b"\x00" * 8, token_count=16)],
        )
        try:
            ack = stub.ReportCacheState(iter([update]), timeout=s.timeout, metadata=md)
            sv.probe_ack = "accepted" if ack.accepted else f"refused: {ack.reason_code}"
        except grpc.RpcError as e:
            sv.probe_ack = f"error: {_rpc_error(e)}"
        try:
            req = pb.LookupRouteRequest(
                model_id=model, tenant_id=PROBE_TENANT, hash_scheme=scheme,
                prefix_hash=b"\x00" * 8, prefix_token_count=16,
            )
            sv.probe_lookup = stub.LookupRoute(req, timeout=s.timeout, metadata=md).reason_code
        except grpc.RpcError as e:
            sv.probe_lookup = f"error: {_rpc_error(e)}"


def _rpc_error(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code is not None else 'UNKNOWN'}: {' '.join(str(details).split())}"
