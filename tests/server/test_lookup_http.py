"""The HTTP lookup listener (``serve --lookup-http-address``) against the gRPC method: the same
answers for the same requests (they share ``LookupPath``), over real sockets on loopback."""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf import json_format

from inferencecache import fingerprint
from inferencecache.index.clock import FakeClock
from inferencecache.index.tenant_config import IndexConfig, TenantPolicy
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.server.helpers import CONFIG, MODEL, PERMISSIVE, SCHEME, TENANT, chain_entry, update

AFFINITY = TenantPolicy(minimum_matched_tokens=32, routing_floor_score=0.0, affinity_routing=True)
MIXED = IndexConfig(policies={TENANT: PERMISSIVE, "aff": AFFINITY})


class Http:
    """One keep-alive HTTP/1.1 connection to the lookup listener."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=10)

    def post(self, path: str, body: bytes, ctype: str) -> tuple[int, str, bytes]:
        self.conn.request("POST", path, body, {"Content-Type": ctype})
        r = self.conn.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read()

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def srv() -> Iterator[RunningServer]:
    with running_server(config=MIXED, clock=FakeClock(), lookup_http=True) as s:
        yield s


@pytest.fixture
def client(srv: RunningServer) -> Iterator[Http]:
    c = Http(srv.lookup_url)
    yield c
    c.close()


def _no_latency(msg: pb.LookupRouteResponse) -> pb.LookupRouteResponse:
    msg.lookup_latency_us = 0
    return msg


def _random_state(srv: RunningServer, rnd: random.Random) -> list[list[int]]:
    """A few replicas over two tenants, two models, two adapters and every tier, with stats;
    returns the token sequences stored (the queries are built from them)."""
    seqs: list[list[int]] = []
    updates: list[pb.CacheStateUpdate] = []
    for _ in range(40):
        base = rnd.choice(seqs) if seqs and rnd.random() < 0.6 else []
        keep = rnd.randrange(0, len(base) // 16 + 1) * 16 if base else 0
        toks = base[:keep] + [rnd.randrange(50_000) for _ in range(16 * rnd.randrange(1, 12))]
        seqs.append(toks)
        tenant = rnd.choice([TENANT, TENANT, "aff"])
        stats = pb.ReplicaStats(cache_memory_bytes=rnd.randrange(10**9),
                                hit_rate=rnd.random(), pressure=rnd.random())
        updates.append(update(
            f"r{rnd.randrange(6)}",
            [chain_entry(toks, tier=rnd.choice([0, 1, 2, 3]),
                         adapter=rnd.choice(["", "", "lora"]))],
            tenant=tenant, model=rnd.choice([MODEL, MODEL, "m2"]),
            stats=stats if rnd.random() < 0.5 else None,
        ))  # fmt: skip
    ack = srv.stub().ReportCacheState(iter(updates), timeout=30)
    assert ack.accepted
    return seqs


def _random_request(rnd: random.Random, seqs: list[list[int]]) -> pb.LookupRouteRequest:
    toks = list(rnd.choice(seqs))
    cut = rnd.random()
    if cut < 0.3:
        toks = toks[: rnd.randrange(0, len(toks) + 1)]
    elif cut < 0.5:
        toks = toks + [rnd.randrange(50_000) for _ in range(rnd.randrange(1, 40))]
    req = pb.LookupRouteRequest(
        tenant_id=rnd.choice([TENANT, TENANT, "aff", "nobody"]),
        model_id=rnd.choice([MODEL, MODEL, "m2", "unknown"]),
        hash_scheme=rnd.choice([SCHEME, SCHEME, SCHEME, "other"]),
        adapter_id=rnd.choice(["", "", "", "lora"]),
    )
    shape = rnd.random()
    if shape < 0.55:
        hashes, counts = fingerprint.chain(toks, 16)
        req.block_hashes.extend(hashes)
        req.block_token_counts.extend(counts)
        if rnd.random() < 0.05 and counts:
            req.block_token_counts.pop()  # unequal chain arrays: fail-open
    elif shape < 0.85:
        req.token_ids.extend(toks)
    elif shape < 0.95:
        hashes, _ = fingerprint.chain(toks, 16)
        if hashes:
            req.prefix_hash = hashes[-1]
            req.prefix_token_count = 16 * len(hashes)
    else:
        req.prompt_text = "no tokenizer loaded"
    if rnd.random() < 0.2:
        req.slo.ttft_ms = rnd.choice([50, 500])
    return req


def test_http_and_grpc_give_identical_answers(srv: RunningServer, client: Http) -> None:
    """Thousands of random requests: the gRPC answer, the HTTP protobuf answer (byte for byte)
    and the HTTP JSON answer (parsed back by protobuf) are the same message."""
    rnd = random.Random(1616)
    seqs = _random_state(srv, rnd)
    grpc_call = srv.channel().unary_unary(
        "/inferencecache.v1alpha1.InferenceCache/LookupRoute",
        response_deserializer=pb.LookupRouteResponse.FromString,
    )
    reasons: dict[str, int] = {}
    for _ in range(2000):
        req = _random_request(rnd, seqs)
        body = req.SerializeToString()
        want = _no_latency(grpc_call(body, timeout=10))
        status, ctype, raw = client.post("/v1/lookup", body, "application/x-protobuf")
        assert (status, ctype) == (200, "application/x-protobuf")
        assert _no_latency(pb.LookupRouteResponse.FromString(raw)) == want
        jbody = json_format.MessageToJson(req, preserving_proto_field_name=rnd.random() < 0.8)
        status, ctype, raw = client.post("/v1/lookup", jbody.encode(), "application/json")
        assert (status, ctype) == (200, "application/json")
        doc = json.loads(raw)
        assert set(doc) == {"replica_scores", "reason_code", "lookup_latency_us", "token_ids",
                            "adapter_id"}
        got = json_format.Parse(raw, pb.LookupRouteResponse())
        assert _no_latency(got) == want, (req, raw)
        reasons[want.reason_code] = reasons.get(want.reason_code, 0) + 1
    # the random requests reach every kind of answer
    assert {"PREFIX_MATCH", "NO_HINT", "AFFINITY_HINT", "UNKNOWN_MODEL"} <= set(reasons), reasons


def test_dynamo_query_shape_matches_grpc_token_lookup(srv: RunningServer, client: Http) -> None:
    """``POST /query`` (Dynamo's indexer request) answers what a token-id LookupRoute answers,
    in Dynamo's response shape: matched tokens per replica under dp rank "0"."""
    rnd = random.Random(7)
    seqs = _random_state(srv, rnd)
    stub = srv.stub()
    matched = 0
    for _ in range(300):
        toks = list(rnd.choice(seqs))[: rnd.randrange(1, 200)]
        want = stub.LookupRoute(pb.LookupRouteRequest(
            tenant_id=TENANT, model_id=MODEL, hash_scheme=SCHEME, token_ids=toks), timeout=10)
        body = json.dumps({"token_ids": toks, "model_name": MODEL, "tenant_id": TENANT}).encode()
        status, ctype, raw = client.post("/query", body, "application/json")
        assert (status, ctype) == (200, "application/json")
        doc = json.loads(raw)
        assert set(doc) == {"scores", "frequencies", "instances"}
        expect = {s.replica_id: {"0": s.matched_tokens} for s in want.replica_scores
                  if want.reason_code == "PREFIX_MATCH" and s.matched_tokens > 0}
        assert doc["scores"] == expect
        assert set(doc["instances"]) == set(expect)
        for rid, inst in doc["instances"].items():
            n = expect[rid]["0"]
            assert inst["longest_matched"] == n and inst["dp"] == {"0": n} and inst["disk"] == n
        matched += bool(expect)
    assert matched > 30


def test_dynamo_query_defaults_and_errors(srv: RunningServer, client: Http) -> None:
    """Dynamo's statuses for bad bodies; tenant ``default`` and scheme ``vllm`` by default."""
    toks = list(range(64))
    srv.stub().ReportCacheState(iter([update("r1", [chain_entry(toks)], tenant="default")]),
                                timeout=10)
    ok = json.dumps({"token_ids": toks, "model_name": MODEL}).encode()
    status, _, raw = client.post("/query", ok, "application/json")
    assert status == 200 and json.loads(raw)["scores"] == {"r1": {"0": 64}}
    assert client.post("/query", b"{nope", "application/json")[0] == 400
    assert client.post("/query", b'{"token_ids": [1]}', "application/json")[0] == 422
    assert client.post("/query", b'{"token_ids": [-1], "model_name": "m"}',
                       "application/json")[0] == 422
    assert client.post("/query", ok, "text/plain")[0] == 415
    undecodable = srv.metrics.registry.get_sample_value(
        "inferencecache_server_undecodable_requests_total", {"method": "http:/query"})
    assert undecodable == 3


def test_v1_lookup_fails_open_like_grpc(srv: RunningServer, client: Http) -> None:
    """An undecodable body is a 200 ``NO_HINT`` (counted), as the gRPC method answers it; JSON
    that only protobuf's mapping accepts (camelCase, null, numbers as strings) is read by it."""
    for body, ctype in ((b"\xff\xff\xff", "application/x-protobuf"),
                        (b"[1, 2", "application/json"),
                        (b'{"no_such_field": 1}', "application/json")):
        status, _, raw = client.post("/v1/lookup", body, ctype)
        assert status == 200
        msg = (pb.LookupRouteResponse.FromString(raw) if ctype.endswith("protobuf")
               else json_format.Parse(raw, pb.LookupRouteResponse()))
        assert msg.reason_code == "NO_HINT" and not msg.replica_scores
    bad = srv.metrics.registry.get_sample_value(
        "inferencecache_server_undecodable_requests_total", {"method": "http:/v1/lookup"})
    assert bad == 3
    toks = list(range(100, 164))
    srv.stub().ReportCacheState(iter([update("r9", [chain_entry(toks)])]), timeout=10)
    body = json.dumps({"tenantId": TENANT, "modelId": MODEL, "hashScheme": SCHEME,
                       "adapter_id": None, "tokenIds": [str(t) for t in toks]}).encode()
    status, _, raw = client.post("/v1/lookup", body, "application/json")
    doc = json.loads(raw)
    assert status == 200 and doc["reason_code"] == "PREFIX_MATCH"
    assert doc["replica_scores"][0]["replica_id"] == "r9"
    assert doc["replica_scores"][0]["matched_tokens"] == 64
    assert doc["replica_scores"][0]["tier"] == "CACHE_TIER_T1"


def test_routes_methods_and_size_bound(srv: RunningServer, client: Http) -> None:
    assert client.post("/v1/other", b"", "application/json")[0] == 404
    client.conn.request("GET", "/v1/lookup")
    r = client.conn.getresponse()
    r.read()
    assert r.status == 405 and r.getheader("Allow") == "POST"
    big = b"0" * (16 * 1024 * 1024 + 1)
    assert Http(srv.lookup_url).post("/v1/lookup", big, "application/json")[0] == 413


def test_lookup_http_address_is_off_by_default() -> None:
    with running_server(config=CONFIG) as s:
        assert s.server.lookup_http_port is None


def test_pipelined_requests_are_answered_in_order(srv: RunningServer) -> None:
    """A ``prompt_text`` lookup is answered off the event loop; requests pipelined behind it on
    the same connection still get their answers after it, in order."""
    import socket

    host, port = srv.lookup_url.removeprefix("http://").split(":")
    slow = json.dumps({"tenant_id": TENANT, "model_id": "first", "prompt_text": "hi"}).encode()
    fast = [json.dumps({"tenant_id": TENANT, "model_id": f"m{i}", "adapter_id": f"a{i}",
                        "token_ids": list(range(32))}).encode() for i in range(3)]
    wire = b"".join(
        b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(b), b) for b in [slow, *fast])
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(wire)
        f = s.makefile("rb")
        answers = []
        for _ in range(4):
            status = f.readline()
            assert status.startswith(b"HTTP/1.1 200 ")
            length = 0
            while (line := f.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            answers.append(json.loads(f.read(length)))
    assert [a["adapter_id"] for a in answers[1:]] == ["a0", "a1", "a2"]
    assert answers[0]["reason_code"] == "NO_HINT" and answers[0]["adapter_id"] == ""


def test_a_lookup_bug_fails_open_and_is_counted_on_http_too(srv: RunningServer,
                                                            client: Http) -> None:
    """The HTTP path shares the gRPC method's last line of defence (``LookupPath``)."""
    backend: Any = srv.backend
    real = backend.lookup

    def bad_lookup(request: Any) -> Any:
        if request.tenant_id == "boom":
            raise MemoryError
        return real(request)

    backend.lookup = bad_lookup
    body = json.dumps({"tenant_id": "boom", "model_id": "m", "token_ids": list(range(32))})
    status, _, raw = client.post("/v1/lookup", body.encode(), "application/json")
    assert status == 200 and json.loads(raw)["reason_code"] == "NO_HINT"
    assert srv.metrics.registry.get_sample_value(
        "inferencecache_server_dropped_inputs_total",
        {"loop": "http:/v1/lookup", "reason": "memory"}) == 1
    assert srv.metrics.registry.get_sample_value("inferencecache_server_lookup_errors_total") == 1


def test_request_target_and_header_bounds(srv: RunningServer) -> None:
    """A request target over 8 KiB is 414, header fields over 64 KiB are 431; both close the
    connection, and the listener goes on serving."""
    import socket

    host, port = srv.lookup_url.removeprefix("http://").split(":")
    for wire, status in (
        (b"POST /v1/lookup?" + b"x" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"414"),
        (b"POST /v1/lookup HTTP/1.1\r\n" + b"X-A: " + b"y" * 70000 + b"\r\n\r\n", b"431"),
    ):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(wire)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 " + status), answer[:60]
    ok = Http(srv.lookup_url)
    try:
        assert ok.post("/v1/lookup", b"{}", "application/json")[0] == 200
    finally:
        ok.close()
