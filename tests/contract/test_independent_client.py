"""An independent client: its own copy of the ``.proto``, compiled under another import root into
a throwaway package, drives all 8 RPCs of the real server from a separate process
(contract-and-index.md §10 items 2-5, §5.14, §5.15; issue "Done when": any v1alpha1 client
works unchanged).

The copy registers a different file name (``thirdparty/ic_contract.proto``) with the same package,
so it cannot share a process with our generated stubs; the client runs in a subprocess that never
imports ``inferencecache``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferencecache.index.pd_topology import PDTopology
from inferencecache.server.testing import RunningServer, running_server
from tests.server.helpers import CONFIG

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "inferencecache" / "v1alpha1" / "inferencecache.proto"

CLIENT = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[2])
assert "inferencecache" not in sys.modules
import grpc
from thirdparty import ic_contract_pb2 as pb, ic_contract_pb2_grpc as pb_grpc
assert pb.DESCRIPTOR.name == "thirdparty/ic_contract.proto"
out = {}
with grpc.insecure_channel(sys.argv[1]) as ch:
    stub = pb_grpc.InferenceCacheStub(ch)
    # an observer of tenant t from the start (contract-and-index.md §13.1): a stats-only update
    # of replica "w" until its REPLICA_UPDATED arrives tells that the stream is open
    seen = []
    ev_stream = stub.StreamCacheEvents(pb.StreamEventsRequest(tenant_id="t"), timeout=60)
    def read():
        try:
            for e in ev_stream:
                seen.append(e)
        except grpc.RpcError:
            pass
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for _ in range(200):
        stub.ReportCacheState(iter([pb.CacheStateUpdate(
            replica_id="w", model_id="w", tenant_id="t", stats=pb.ReplicaStats())]), timeout=10)
        if seen:
            break
        time.sleep(0.05)
    ack = stub.ReportCacheState(iter([]), timeout=10)
    out["ReportCacheState_empty"] = [ack.accepted, ack.reason_code]
    upd = pb.CacheStateUpdate(
        replica_id="r1", model_id="m", tenant_id="t", hash_scheme="vllm",
        prefixes=[pb.PrefixEntry(prefix_hash=b"p" * 8, token_count=128, tier=pb.CACHE_TIER_T2)],
        stats=pb.ReplicaStats(hit_rate=0.5),
    )
    ack = stub.ReportCacheState(iter([upd]), timeout=10)
    out["ReportCacheState"] = [ack.accepted, ack.reason_code]
    r = stub.LookupRoute(pb.LookupRouteRequest(
        model_id="m", tenant_id="t", hash_scheme="vllm", prefix_hash=b"p" * 8), timeout=10)
    out["LookupRoute"] = [r.reason_code, [(s.replica_id, s.matched_tokens, s.tier)
                                          for s in r.replica_scores]]
    pd = stub.LookupPDRoute(pb.LookupPDRouteRequest(
        model_id="m", tenant_id="t", prefix_hash=b"p" * 8, prefix_token_count=128,
        pd_topology_ref="pd"), timeout=10)
    out["LookupPDRoute_hit"] = [pd.reason_code, pd.prefill_replica_id, pd.decode_replica_id,
                                pd.transport_hint]
    g = stub.GetCacheState(pb.GetCacheStateRequest(model_id="m", tenant_id="t"), timeout=10)
    out["GetCacheState"] = [[x.replica_id for x in g.replicas], g.summary.total_prefixes]
    ev = stub.PublishEvent(pb.CacheEvent(
        type=pb.CacheEvent.PREFIX_EVICTED, replica_id="r1", model_id="m", tenant_id="t",
        prefix_hash=b"p" * 8), timeout=10)
    out["PublishEvent"] = [ev.accepted, ev.reason_code]
    r = stub.LookupRoute(pb.LookupRouteRequest(
        model_id="m", tenant_id="t", hash_scheme="vllm", prefix_hash=b"p" * 8), timeout=10)
    out["LookupRoute_after_evict"] = r.reason_code
    rt = stub.RenderTemplate(pb.RenderTemplateRequest(template_ref="x"), timeout=10)
    out["RenderTemplate"] = [rt.reason_code, rt.rendered_prompt.decode()]
    rt = stub.RenderTemplate(pb.RenderTemplateRequest(
        template_ref="greet", tenant_id="t", variables={"name": "Ada"}), timeout=10)
    out["RenderTemplate_ok"] = [rt.reason_code, rt.rendered_prompt.decode(),
                                len(rt.stable_prefix_hash), rt.tenant_namespace.decode()]
    rt = stub.RenderTemplate(pb.RenderTemplateRequest(
        template_ref="greet", tenant_id="t"), timeout=10)
    out["RenderTemplate_error"] = rt.reason_code
    pd = stub.LookupPDRoute(pb.LookupPDRouteRequest(model_id="m"), timeout=10)
    out["LookupPDRoute"] = [pd.reason_code, pd.prefill_replica_id, pd.decode_replica_id,
                            pd.transport_hint]
    for _ in range(200):
        if len([e for e in seen if e.model_id == "m"]) >= 3:
            break
        time.sleep(0.05)
    ev_stream.cancel()
    reader.join(10)
    out["StreamCacheEvents"] = [
        [pb.CacheEvent.Type.Name(e.type), e.replica_id, e.prefix_hash.decode()]
        for e in seen if e.model_id == "m"]
    m_stream = stub.StreamMetrics(pb.StreamMetricsRequest(names=["inferencecache_server_up"]),
                                  timeout=10)
    m = next(m_stream)
    m_stream.cancel()
    out["StreamMetrics"] = [m.name, m.type, m.value, m.timestamp_us > 0]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Compile a private copy of the contract into ``<tmp>/gen/thirdparty``."""
    tmp = tmp_path_factory.mktemp("independent")
    src = tmp / "protos" / "thirdparty"
    src.mkdir(parents=True)
    shutil.copyfile(PROTO, src / "ic_contract.proto")
    gen = tmp / "gen"
    gen.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{tmp / 'protos'}",
            f"--python_out={gen}",
            f"--grpc_python_out={gen}",
            str(src / "ic_contract.proto"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (gen / "thirdparty" / "ic_contract_pb2_grpc.py").exists()
    return gen


GREETING = "You are the assistant of the independent client test. Greet the user: "
TOPOLOGY = PDTopology(name="pd", transport="Direct", prefill=("r1",), decode=("r1",))


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[RunningServer]:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "greet.j2").write_text(GREETING + "{{ name }}", encoding="utf-8")
    with running_server(
        config=CONFIG, template_dir=tmp_path, pd_topologies={"pd": TOPOLOGY}
    ) as s:
        yield s


def test_c10_02_to_05_and_c13_1_independent_client_calls_every_rpc(
    generated: Path, srv: RunningServer
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, srv.grpc_target, str(generated)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=generated,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {
        "ReportCacheState_empty": [True, ""],
        "ReportCacheState": [True, ""],
        "LookupRoute": ["PREFIX_MATCH", [["r1", 128, 2]]],
        "GetCacheState": [["r1"], 1],
        "PublishEvent": [True, ""],
        "LookupRoute_after_evict": "NO_HINT",
        "LookupPDRoute_hit": ["PREFIX_MATCH", "r1", "r1", "Direct"],
        "RenderTemplate": ["TEMPLATE_NOT_FOUND", ""],
        "RenderTemplate_ok": ["OK", GREETING + "Ada", 8, "t"],
        "RenderTemplate_error": "RENDER_ERROR",
        "LookupPDRoute": ["NO_HINT", "", "", ""],
        "StreamCacheEvents": [
            ["PREFIX_ADDED", "r1", "pppppppp"],
            ["REPLICA_UPDATED", "r1", ""],
            ["PREFIX_EVICTED", "r1", "pppppppp"],
        ],
        "StreamMetrics": ["inferencecache_server_up", "gauge", 1.0, True],
    }
