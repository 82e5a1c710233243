"""``inferencecache serve`` as a process: flags, env vars, exit codes, graceful SIGTERM."""

from __future__ import annotations

import json
import queue
import signal
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferencecache.procs import Child, Children, run_cli
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.server.helpers import chain_entry, lookup_chain, tokens, update, wait_for

LOCAL = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"]


@pytest.fixture
def procs() -> Iterator[Children]:
    with Children() as started:
        yield started


def start(procs: Children, args: list[str], env: dict[str, str] | None = None) -> Child:
    """``inferencecache serve`` with exactly these flags and settings (none inherited)."""
    return procs.start("serve", *args, env=env, inherit=False)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_serve_sigterm_graceful_shutdown(procs: Children, tmp_path: Path) -> None:
    """SIGTERM: health turns NOT_SERVING, an in-flight stream still gets its Ack, exit 0."""
    p = start(procs, [*LOCAL, "--shutdown-grace", "30s"])
    rec = p.wait_log("serving")
    target = f"127.0.0.1:{port_of(rec['grpc_address'])}"
    http = f"http://127.0.0.1:{port_of(rec['http_address'])}"
    assert urllib.request.urlopen(http + "/healthz", timeout=10).read() == b"ok\n"
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
        health = health_pb2_grpc.HealthStub(ch)  # type: ignore[no-untyped-call]
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

        q: queue.Queue[pb.CacheStateUpdate | None] = queue.Queue()

        def feed() -> Iterator[pb.CacheStateUpdate]:
            while (item := q.get()) is not None:
                yield item

        fut = stub.ReportCacheState.future(feed(), timeout=60)
        try:
            q.put(update("r1", [chain_entry(tokens(32))]))
            wait_for(
                lambda: (
                    stub.LookupRoute(lookup_chain(tokens(32)), timeout=10).reason_code
                    != "UNKNOWN_TENANT"
                )
            )
            p.signal(signal.SIGTERM)
            p.wait_log(lambda r: r.get("msg") == "shutting down")
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
        finally:
            q.put(None)
        assert fut.result(timeout=30) == pb.Ack(accepted=True)
    assert p.wait(30) == 0
    p.wait_log(lambda r: r.get("msg") == "stopped")


def test_serve_env_vars_configure_every_flag(procs: Children, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("tok\n")
    env = {
        "INFERENCECACHE_GRPC_ADDRESS": "127.0.0.1:0",
        "INFERENCECACHE_HTTP_ADDRESS": "127.0.0.1:0",
        "INFERENCECACHE_ADMIN_ADDRESS": "127.0.0.1:0",
        "INFERENCECACHE_ADMIN_TOKEN_FILE": str(token),
        "INFERENCECACHE_BLOCK_SIZE": "32",
        "INFERENCECACHE_LOG_LEVEL": "debug",
    }
    p = start(procs, [], env)
    rec = p.wait_log("serving")
    assert rec["block_size"] == 32
    assert rec["admin_auth"] is True
    admin = f"http://127.0.0.1:{port_of(rec['admin_address'])}"
    req = urllib.request.Request(admin + "/snapshot", headers={"Authorization": "Bearer tok"})
    assert json.loads(urllib.request.urlopen(req, timeout=10).read())["totalPrefixes"] == 0
    p.signal(signal.SIGINT)
    assert p.wait(30) == 0


def test_serve_flag_wins_over_env(procs: Children) -> None:
    p = start(procs, [*LOCAL, "--block-size", "64"], {"INFERENCECACHE_BLOCK_SIZE": "32"})
    assert p.wait_log("serving")["block_size"] == 64


def test_serve_policy_file_is_loaded(procs: Children, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "policies:\n  - tenant_id: t\n    minimum_matched_tokens: 0\n"
        "tenants:\n  - tenant_id: t\n    max_index_entries: 10\n"
    )
    p = start(procs, [*LOCAL, "--policy-file", str(policy)])
    rec = p.wait_log("serving")
    assert (rec["policies"], rec["quotas"]) == (1, 1)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--http-address", "0.0.0.0:0"], "--http-address 0.0.0.0:0"),
        (["--grpc-address", ":0"], "--grpc-address :0"),
        (["--admin-address", "0.0.0.0:0"], "--admin-address 0.0.0.0:0"),
    ],
)
def test_bad_input_non_loopback_without_token_exits_2(args: list[str], needle: str) -> None:
    base = {"--grpc-address": "127.0.0.1:0", "--http-address": "127.0.0.1:0"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    flat = [x for kv in base.items() for x in kv]
    res = run_cli(["serve", *flat])
    assert res.returncode == 2
    line = one_error_line(res.stderr)
    assert needle in line and "--admin-token-file" in line


def test_non_loopback_with_token_starts(procs: Children, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc")
    p = start(
        procs,
        [
            "--grpc-address",
            "127.0.0.1:0",
            "--http-address",
            "0.0.0.0:0",
            "--admin-token-file",
            str(token),
        ],
    )
    rec = p.wait_log("serving")
    port = port_of(rec["http_address"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
        assert r.status == 200
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/snapshot", timeout=10)
        raise AssertionError("expected 401")
    except urllib.error.HTTPError as e:
        assert e.code == 401


def test_bad_input_policy_file_names_the_field(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "policies:\n  - tenant_id: a\n  - tenant_id: b\n    routing_floor_score: -1\n"
    )
    res = run_cli(["serve", *LOCAL, "--policy-file", str(policy)])
    assert res.returncode == 2
    assert "policies[1].routing_floor_score" in one_error_line(res.stderr)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--policy-file", "/nonexistent/p.yaml"], "/nonexistent/p.yaml"),
        (["--admin-token-file", "/nonexistent/token"], "/nonexistent/token"),
        (["--tokenizer-dir", "/nonexistent/tok"], "/nonexistent/tok"),
        (["--pd-topology-file", "/nonexistent/pd.yaml"], "/nonexistent/pd.yaml"),
        (["--template-dir", "/nonexistent/templates"], "/nonexistent/templates"),
        (["--grpc-address", "localhost"], "--grpc-address"),
        (["--http-address", "127.0.0.1:99999"], "--http-address"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--default-ttl", "10"], "--default-ttl"),
        (["--max-holds", "-1"], "--max-holds"),
        (["--log-level", "loud"], "--log-level"),
        (["--store-backend", "redis"], "--store-backend"),
        (["--workers", "2"], "--workers"),
        (["--snapshot-dir", "/tmp/x"], "--snapshot-dir"),
        (["--event-log", "http://127.0.0.1:6379"], "--event-log"),
        (["--event-log", "redis://127.0.0.1:6379/x"], "--event-log"),
        (["--event-log", "redis://127.0.0.1:6379", "--workers", "0"], "--workers"),
        (["--event-log", "redis://127.0.0.1:6379", "--max-replica-lag", "0"],
         "--max-replica-lag"),
        (["--event-log", "redis://127.0.0.1:6379", "--event-log-key", "a{b}"],
         "--event-log-key"),
        (["--event-log", "redis://127.0.0.1:6379", "--event-log-password-file",
          "/nonexistent/pw"], "/nonexistent/pw"),
    ],
)
def test_bad_input_startup_errors_exit_2_with_one_line(extra: list[str], needle: str) -> None:
    res = run_cli(["serve", *LOCAL, *extra])
    assert res.returncode == 2, res.stderr
    assert needle in one_error_line(res.stderr)


def test_bad_input_empty_token_file(tmp_path: Path) -> None:
    token = tmp_path / "empty"
    token.write_text("\n")
    res = run_cli(["serve", *LOCAL, "--admin-token-file", str(token)])
    assert res.returncode == 2
    assert "empty" in one_error_line(res.stderr)


def test_bad_input_port_in_use_exits_2() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for flag in ("--http-address", "--grpc-address"):
            args = {"--grpc-address": "127.0.0.1:0", "--http-address": "127.0.0.1:0"}
            args[flag] = f"127.0.0.1:{port}"
            res = run_cli(["serve", *[x for kv in args.items() for x in kv]])
            assert res.returncode == 2, res.stderr
            line = one_error_line(res.stderr)
            assert flag in line and str(port) in line


def test_c5_14_bad_topology_file_names_the_field(tmp_path: Path) -> None:
    topo = tmp_path / "pd.yaml"
    topo.write_text(
        "topologies:\n  - {name: a, transport: NIXL, prefill: [p], decode: [d]}\n"
        "  - {name: b, transport: RDMA, prefill: [p], decode: [d]}\n"
    )
    res = run_cli(["serve", *LOCAL, "--pd-topology-file", str(topo)])
    assert res.returncode == 2
    line = one_error_line(res.stderr)
    assert "--pd-topology-file" in line and "topologies[1].transport" in line


def test_bad_tokenizer_dir_exits_2(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.json").write_text("{broken")
    res = run_cli(["serve", *LOCAL, "--tokenizer-dir", str(tmp_path)])
    assert res.returncode == 2
    assert "m/tokenizer.json" in one_error_line(res.stderr)


def test_serve_help_lists_env_names() -> None:
    res = run_cli(["serve", "--help"])
    assert res.returncode == 0
    for env in (
        "INFERENCECACHE_GRPC_ADDRESS",
        "INFERENCECACHE_ADMIN_TOKEN_FILE",
        "INFERENCECACHE_TENANT_HOT_MAX_AGE",
        "INFERENCECACHE_BLOCK_SIZE",
    ):
        assert env in res.stdout


@pytest.mark.parametrize("backend", ["python", "native"])
def test_serve_store_backend_flag(procs: Children, backend: str) -> None:
    """``--store-backend`` picks the index store; both answer the same lookup, and the server's
    /metrics counts what compiled code handed back to Python (a group: protobuf decides)."""
    from inferencecache.index.backends import STORE_BACKENDS

    if backend not in STORE_BACKENDS:
        pytest.fail(f"the {backend} store is not built here (scripts/check requires it)")
    p = start(procs, [*LOCAL, "--store-backend", backend])
    rec = p.wait_log("serving")
    assert rec["store_backend"] == backend
    target = f"127.0.0.1:{port_of(rec['grpc_address'])}"
    http = f"http://127.0.0.1:{port_of(rec['http_address'])}"
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
        assert stub.ReportCacheState(iter([update("r1", [chain_entry(tokens(64))])]), timeout=10)
        req = lookup_chain(tokens(64))
        scores = wait_for(lambda: stub.LookupRoute(req, timeout=10).replica_scores)
        assert [s.replica_id for s in scores] == ["r1"]
        raw = ch.unary_unary("/inferencecache.v1alpha1.InferenceCache/LookupRoute")
        grouped = req.SerializeToString() + b"\x63\x64"  # an empty group (field 12)
        assert pb.LookupRouteResponse.FromString(raw(grouped, timeout=10)).replica_scores
    metrics = urllib.request.urlopen(http + "/metrics", timeout=10).read().decode()
    assert 'inferencecache_native_fallbacks_total{site="lookup_request"}' in metrics
