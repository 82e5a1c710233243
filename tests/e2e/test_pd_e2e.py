"""The gateway's P/D mode end to end (contract-and-index.md §5.14, docs/gateway.md).

Processes: ``serve --pd-topology-file``, four ``fake-engine --mode simulated`` (p0, p1 with
``--kv-role prefill``; d0, d1 with ``--kv-role decode``), one ``subscribe --replica-role`` per
engine, and ``gateway --pd-topology``; all on ports chosen at run time, stopped by PID.

p1 is warmed with the prompt (its subscriber reports the blocks), d0 is kept busy with long
requests (its subscriber reports the load as pressure). A request through the gateway must then
be prefilled on p1 (the cache-best prefill replica; p1's engine hits its cache) and decoded on d1
(the least-loaded decode replica), the decode engine receiving p1's ``kv_transfer_params``.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferencecache import fingerprint
from inferencecache.procs import Children
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.tokenize.tinytok import write_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "m"
BLOCK = 16
TOPOLOGY = """
topologies:
  - name: pd
    transport: NIXL
    prefill: [p0, p1]
    decode: [d0, d1]
"""
ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}


@dataclass
class Fleet:
    tokdir: Path
    children: Children = field(default_factory=Children)
    grpc_address: str = ""
    engines: dict[str, str] = field(default_factory=dict)  # replica -> host:port
    engine_ids: dict[str, str] = field(default_factory=dict)  # replica -> kv_engine_id
    stub: Any = None
    channel: grpc.Channel | None = None

    def gateway(self, topology: str) -> str:
        engines = ",".join(f"{rid}=http://{addr}" for rid, addr in sorted(self.engines.items()))
        p = self.children.start(
            "gateway", "--engines", engines, "--server", self.grpc_address,
            "--http-address", "127.0.0.1:0", "--block-size", str(BLOCK),
            "--tokenizer-dir", str(self.tokdir), "--health-interval", "500ms",
            "--pd-topology", topology,
        )  # fmt: skip
        return str(p.wait_log("serving", timeout=30)["http_address"])

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.children.stop_all()


def http(url: str, body: Any | None = None, timeout: float = 30) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            ctype = r.headers.get("Content-Type", "")
            return r.status, dict(r.headers), json.loads(raw) if "json" in ctype else raw
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


def kv_transfers(addr: str) -> dict[tuple[str, str], float]:
    page = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    out = {}
    for m in re.finditer(
        r'^inferencecache_engine_kv_transfers_total\{peer="([^"]*)",side="([^"]*)"\} (\S+)$',
        page,
        re.M,
    ):
        out[(m.group(2), m.group(1))] = float(m.group(3))
    return out


def wait(what: str, check: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("pd")
    write_model(tmp / "tok", MODEL, with_bos_post_processor=True)
    (tmp / "pd.yaml").write_text(TOPOLOGY)
    f = Fleet(tmp / "tok")
    try:
        rec = f.children.start(
            "serve", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--block-size", str(BLOCK), "--pd-topology-file", str(tmp / "pd.yaml"),
        ).wait_log("serving", timeout=30)  # fmt: skip
        f.grpc_address = rec["grpc_address"]
        f.channel = grpc.insecure_channel(f.grpc_address)
        f.stub = pb_grpc.InferenceCacheStub(f.channel)  # type: ignore[no-untyped-call]
        for rid, role in ROLES.items():
            eng = f.children.start(
                "fake-engine", "--mode", "simulated", "--bind", "tcp://127.0.0.1:0",
                "--http-address", "127.0.0.1:0", "--block-size", str(BLOCK),
                "--model-name", MODEL, "--gpu-blocks", "1024", "--kv-role", role,
                "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "1",
            )  # fmt: skip
            ready = eng.wait_log("simulated engine ready", timeout=30)
            assert ready["kv_role"] == role
            f.engines[rid] = ready["http_address"]
            f.engine_ids[rid] = ready["kv_engine_id"]
            sub = f.children.start(
                "subscribe", "--replica-id", rid, "--model-id", MODEL, "--replica-role", role,
                "--engine-endpoint", ready["endpoint"], "--server", f.grpc_address,
                "--metrics-address", "127.0.0.1:0", "--window", "20ms",
                "--block-size", str(BLOCK), "--stats-interval", "200ms",
                "--engine-metrics-url", f"http://{ready['http_address']}/metrics",
            )  # fmt: skip
            sub.wait_log("connected to the engine", timeout=30)  # no store lost to ZeroMQ
        yield f
    finally:
        f.close()


def busy(engine: str, body: dict[str, Any]) -> None:
    """One long request; the engine is stopped under it at teardown, which is fine."""
    with contextlib.suppress(OSError):
        http(f"{engine}/v1/completions", body, 120)


def pressures(f: Fleet) -> dict[str, float]:
    state = f.stub.GetCacheState(pb.GetCacheStateRequest(model_id=MODEL, tenant_id="default"))
    return {r.replica_id: r.pressure for r in state.replicas}


def test_c5_14_gateway_pd_mode_prefills_on_cache_best_and_decodes_on_least_loaded(
    fleet: Fleet,
) -> None:
    prompt = list(range(500, 500 + 6 * BLOCK))
    # warm p1: a plain request straight to the engine (a prefill-role engine serves it locally)
    assert http(f"http://{fleet.engines['p1']}/v1/completions",
                {"model": MODEL, "prompt": prompt, "max_tokens": 1})[0] == 200  # fmt: skip
    hashes, _ = fingerprint.chain(prompt, BLOCK)

    def p1_indexed() -> bool:
        r = fleet.stub.LookupRoute(
            pb.LookupRouteRequest(
                model_id=MODEL, tenant_id="default", hash_scheme="vllm",
                prefix_hash=hashes[-1], prefix_token_count=len(prompt),
            ),
            timeout=5,
        )  # fmt: skip
        return bool(r.reason_code == "PREFIX_MATCH" and r.replica_scores[0].replica_id == "p1")

    wait("p1's blocks in the index", p1_indexed)
    # keep d0 busy: long decodes sent straight to it (stopped with the engine at teardown)
    for i in range(3):
        body = {"model": MODEL, "prompt": list(range(9000 + i, 9000 + i + BLOCK)),
                "max_tokens": 60_000}  # fmt: skip
        threading.Thread(target=busy, args=(f"http://{fleet.engines['d0']}", body),
                         daemon=True).start()  # fmt: skip

    def loads_reported() -> bool:
        p = pressures(fleet)
        return "d1" in p and p.get("d0", 0.0) > p["d1"] and "p1" in p

    wait("d0's load reported as pressure", loads_reported)

    gw = fleet.gateway("pd")
    status, headers, body = http(f"http://{gw}/v1/completions",
                                 {"model": MODEL, "prompt": prompt, "max_tokens": 3})  # fmt: skip
    assert status == 200, body
    assert headers["X-Cache-Route-PD-Reason"] == "PREFIX_MATCH"
    assert headers["X-Cache-Route-Prefill-Replica"] == "p1"
    assert headers["X-Cache-Route-Replica"] == "d1"
    assert headers["X-Cache-Route-Transport"] == "NIXL"
    assert "X-Cache-Route-Hint-Us" not in headers  # no LookupRoute on the P/D path
    assert body["usage"]["completion_tokens"] == 3  # the decode answer, not the 1-token prefill
    # the handoff really happened, between exactly these two engines
    assert kv_transfers(fleet.engines["p1"]) == {("producer", ""): 1.0}
    assert kv_transfers(fleet.engines["d1"]) == {("consumer", fleet.engine_ids["p1"]): 1.0}
    assert kv_transfers(fleet.engines["p0"]) == {}
    assert kv_transfers(fleet.engines["d0"]) == {}


def test_c5_14_gateway_pd_unknown_topology_falls_back_to_one_engine(fleet: Fleet) -> None:
    gw = fleet.gateway("no-such-topology")
    prompt = list(range(7000, 7000 + 5 * BLOCK))
    status, headers, body = http(f"http://{gw}/v1/completions",
                                 {"model": MODEL, "prompt": prompt, "max_tokens": 2})  # fmt: skip
    assert status == 200, body
    assert headers["X-Cache-Route-PD-Reason"] == "UNKNOWN_TOPOLOGY"
    assert "X-Cache-Route-Prefill-Replica" not in headers
    assert headers["X-Cache-Route-Replica"] in ROLES
    assert "X-Cache-Route-Hint-Us" in headers  # the fallback routes with the policy's hint
