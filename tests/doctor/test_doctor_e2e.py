"""``inferencecache doctor`` against a real stack on loopback, healthy and misconfigured.

The healthy stack: ``serve`` with an admin token, one simulated engine (OpenAI API, vLLM
metrics, KV events with a replay ROUTER, one LoRA adapter), its subscriber and a gateway; one
request through the gateway for the base model and one for the adapter make events flow. Each
misconfiguration test adds the wrong part next to it (or points doctor somewhere wrong) and
checks the one line that must fail, and exit 1. Every process is stopped by its PID.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferencecache import fingerprint
from inferencecache.procs import Child, Children, RedisServer, free_port, run_cli
from inferencecache.server.testing import running_server
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "doc-model"
ADAPTER = "sql-lora"
BLOCK = 16
TOKEN = "doctor-test-token"


@dataclass
class Stack:
    tmp: Path
    children: Children = field(default_factory=Children)
    grpc: str = ""
    http: str = ""
    engine_http: str = ""
    engine_endpoint: str = ""
    replay_endpoint: str = ""
    subscriber: str = ""
    gateway: str = ""
    token_file: str = ""

    def start(self, *args: str) -> Child:
        return self.children.start(*args)

    def engine(self, *extra: str, block: int = BLOCK) -> dict[str, Any]:
        p = self.start(
            "fake-engine", "--mode", "simulated", "--bind", "tcp://127.0.0.1:0",
            "--replay-endpoint", "tcp://127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--block-size", str(block), "--model-name", MODEL, "--lora-adapters",
            f"1={ADAPTER}", "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "0.1",
            *extra,
        )
        return p.wait_log("simulated engine ready", timeout=30)

    def subscribe(self, replica: str, *extra: str, endpoint: str = "") -> str:
        p = self.start(
            "subscribe", "--replica-id", replica, "--model-id", MODEL,
            "--engine-endpoint", endpoint or self.engine_endpoint, "--server", self.grpc,
            "--metrics-address", "127.0.0.1:0", "--window", "20ms", "--block-size", str(BLOCK),
            "--engine-metrics-url", f"http://{self.engine_http}/metrics",
            "--stats-interval", "1s", *extra,
        )
        return "http://" + str(p.wait_log("metrics listening", timeout=30)["address"])

    def gateway_at(self, *extra: str, engines: str = "") -> str:
        p = self.start(
            "gateway", "--engines", engines or f"r0=http://{self.engine_http}",
            "--server", self.grpc, "--http-address", "127.0.0.1:0",
            "--block-size", str(BLOCK), "--health-interval", "500ms", *extra,
        )
        return "http://" + str(p.wait_log("serving", timeout=30)["http_address"])

    def args(self, *, token: bool = True, engine: bool = True) -> list[str]:
        out = ["--server", self.grpc, "--server-http", f"http://{self.http}",
               "--subscribers", self.subscriber, "--gateways", self.gateway,
               "--events-wait", "1s", "--timeout", "3s"]  # fmt: skip
        if token:
            out += ["--admin-token-file", self.token_file]
        if engine:
            out += ["--engine-url", f"http://{self.engine_http}", "--engine-endpoint",
                    self.engine_endpoint, "--replay-endpoint", self.replay_endpoint]  # fmt: skip
        return out


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " "))


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(6 * BLOCK)]


def wait_indexed(grpc_address: str, tokens: list[int], adapter: str = "") -> None:
    hashes, counts = fingerprint.chain(tokens, BLOCK)
    req = pb.LookupRouteRequest(model_id=MODEL, tenant_id="default", hash_scheme="vllm",
                                adapter_id=adapter, block_hashes=hashes,
                                block_token_counts=counts)  # fmt: skip
    with grpc.insecure_channel(grpc_address) as ch:
        stub = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 30
        while stub.LookupRoute(req, timeout=5).reason_code != "PREFIX_MATCH":
            assert time.monotonic() < deadline, "the stack never indexed the request"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("doctor")
    s = Stack(tmp)
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    s.token_file = str(token)
    redis_dir = tmp / "redis"
    redis_dir.mkdir()
    redis_srv = RedisServer(str(redis_dir)).start()  # the server runs on the event log
    try:
        rec = s.start(
            "serve", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--block-size", str(BLOCK), "--admin-token-file", s.token_file,
            "--event-log", redis_srv.url,
        ).wait_log("serving", timeout=30)
        s.grpc, s.http = rec["grpc_address"], rec["http_address"]
        ready = s.engine()
        s.engine_http, s.engine_endpoint = ready["http_address"], ready["endpoint"]
        s.replay_endpoint = ready["replay_endpoint"]
        s.subscriber = s.subscribe("r0", "--replay-endpoint", s.replay_endpoint,
                                   "--lora-adapter-names", f"1={ADAPTER}")  # fmt: skip
        s.gateway = s.gateway_at()
        for model, seed in ((MODEL, 1), (ADAPTER, 2)):
            tokens = prompt(seed)
            post(s.gateway + "/v1/completions", {"model": model, "prompt": tokens,
                                                  "max_tokens": 1})  # fmt: skip
            wait_indexed(s.grpc, tokens, "" if model == MODEL else ADAPTER)
        yield s
    finally:
        try:
            s.children.stop_all()
        finally:
            redis_srv.stop()


def doctor(*args: str) -> tuple[int, dict[str, str], str]:
    """Exit code, ``{check: status}`` and the whole output of one ``doctor`` run."""
    res = run_cli(["doctor", *args], timeout=60)
    verdicts = {}
    for line in res.stdout.splitlines():
        m = re.match(r"(PASS|FAIL|SKIP)  (.+?): ", line)
        if m:
            verdicts[m.group(2)] = m.group(1)
    return res.returncode, verdicts, res.stdout + res.stderr


def failing(verdicts: dict[str, str]) -> set[str]:
    return {k for k, v in verdicts.items() if v == "FAIL"}


def test_healthy_stack_passes_every_check(stack: Stack) -> None:
    code, verdicts, out = doctor(*stack.args())
    assert code == 0, out
    assert set(verdicts.values()) == {"PASS"}, out
    for check in ("server reachable", "server healthy", "event log", "versions", "block size",
                  "hash scheme",
                  f"subscriber r0 ({stack.subscriber})", f"engine http://{stack.engine_http}",
                  f"engine events {stack.engine_endpoint}", "events flowing r0",
                  "LoRA adapters", f"gateway {stack.gateway}", "probe tenant"):
        assert check in verdicts, out
    assert "newest event" in out and ADAPTER in out
    assert re.search(r"doctor: \d+ passed, 0 failed, 0 skipped", out), out


def test_only_a_server_passes_with_the_rest_skipped(stack: Stack) -> None:
    code, verdicts, out = doctor("--server", stack.grpc, "--server-http", f"http://{stack.http}",
                                 "--admin-token-file", stack.token_file)  # fmt: skip
    assert code == 0, out
    assert verdicts["block size"] == "SKIP" and verdicts["hash scheme"] == "SKIP", out
    assert verdicts["probe tenant"] == "PASS" and verdicts["events flowing r0"] == "PASS", out


def test_unreachable_server_fails_reachable(stack: Stack) -> None:
    port = free_port()
    code, verdicts, out = doctor("--server", f"127.0.0.1:{port}", "--server-http",
                                 f"http://127.0.0.1:{port}", "--timeout", "1s")  # fmt: skip
    assert code == 1, out
    assert verdicts["server reachable"] == "FAIL" and "no gRPC connection" in out, out
    assert verdicts["server healthy"] == "SKIP", out


def test_not_ready_server_fails_healthy() -> None:
    with running_server(start_sweeper=False) as srv:
        code, verdicts, out = doctor("--server", srv.grpc_target, "--server-http", srv.http_url)
    assert code == 1, out
    assert verdicts["server reachable"] == "PASS", out
    assert verdicts["server healthy"] == "FAIL" and "/readyz" in out and "503" in out, out


class _Page(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        data = self.body if self.path == "/metrics" else b"ok"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_version_mismatch_fails_versions(stack: Stack) -> None:
    """An older subscriber cannot run here: its /metrics page is the live subscriber's with
    another version label, served on loopback."""
    with urllib.request.urlopen(stack.subscriber + "/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'version="' in text
    old = re.sub(r'(inferencecache_subscriber_info\{[^}]*version=")[^"]*"', r'\g<1>0.0.1"', text)
    assert old != text
    handler = type("Old", (_Page,), {"body": old.encode()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code, verdicts, out = doctor("--server", stack.grpc, "--server-http",
                                     f"http://{stack.http}", "--subscribers", url)  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert code == 1, out
    assert verdicts["versions"] == "FAIL" and "0.0.1" in out, out


def test_subscriber_block_size_mismatch_fails_block_size(stack: Stack) -> None:
    url = stack.subscribe("r-bs", "--block-size", "32")
    deadline = time.monotonic() + 30
    seed = 100
    while metric(url, "inferencecache_subscriber_batches_received_total") == 0:  # slow joiner
        assert time.monotonic() < deadline, "the subscriber never received a batch"
        seed += 1
        post(stack.gateway + "/v1/completions",
             {"model": MODEL, "prompt": prompt(seed), "max_tokens": 1})  # fmt: skip
        time.sleep(0.2)
    code, verdicts, out = doctor(*stack.args(), "--subscribers", f"{stack.subscriber},{url}")
    assert code == 1, out
    assert verdicts["block size"] == "FAIL", out
    assert verdicts[f"subscriber r-bs ({url})"] == "PASS", out  # it is connected, just wrong
    assert f"subscriber r-bs ({url}) 32" in out, out
    assert "ignored" in out and "events of another block size" in out, out


def test_engine_block_size_mismatch_fails_block_size(stack: Stack) -> None:
    ready = stack.engine(block=32)
    code, verdicts, out = doctor(
        *stack.args(engine=False), "--engine-url", f"http://{ready['http_address']}",
        "--engine-endpoint", ready["endpoint"], "--replay-endpoint", ready["replay_endpoint"],
    )
    assert code == 1, out
    assert verdicts["block size"] == "FAIL" and f"engine http://{ready['http_address']} 32" in out


def test_hash_scheme_mismatch_fails_hash_scheme(stack: Stack) -> None:
    gw = stack.gateway_at("--hash-scheme", "sglang")
    code, verdicts, out = doctor(*stack.args(), "--gateways", gw)
    assert code == 1, out
    assert failing(verdicts) == {"hash scheme"}, out
    assert f"gateway {gw} sglang" in out, out


def test_subscriber_on_a_wrong_endpoint_fails_events_flowing(stack: Stack) -> None:
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    # no stats report during the test either (its first comes one interval after the start; a
    # report would make the replica's row fresh, which events flowing accepts)
    url = stack.subscribe("r-dead", "--stats-interval", "1h", endpoint=nowhere)
    code, verdicts, out = doctor(*stack.args(), "--subscribers", f"{stack.subscriber},{url}")
    assert code == 1, out
    assert verdicts[f"subscriber r-dead ({url})"] == "FAIL", out
    assert verdicts["events flowing r-dead"] == "FAIL", out
    assert verdicts["events flowing r0"] == "PASS", out


def test_silent_engine_endpoint_fails_engine_events(stack: Stack) -> None:
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    code, verdicts, out = doctor(*stack.args(engine=False), "--engine-endpoint", nowhere)
    assert code == 1, out
    assert failing(verdicts) == {f"engine events {nowhere}"}, out
    assert "give --replay-endpoint" in out, out


def test_lora_name_mismatch_fails_lora(stack: Stack) -> None:
    url = stack.subscribe("r-lora", "--lora-adapter-names", "1=chat-lora",
                          "--replay-endpoint", stack.replay_endpoint)  # fmt: skip
    code, verdicts, out = doctor(*stack.args(), "--subscribers", url)
    assert code == 1, out
    assert verdicts["LoRA adapters"] == "FAIL", out
    assert "chat-lora" in out and "does not serve" in out, out
    assert "maps it to 'chat-lora'" in out, out  # the replayed events name id 1 sql-lora


def test_gateway_replica_ids_unknown_to_the_index_fail(stack: Stack) -> None:
    gw = stack.gateway_at(engines=f"ghost=http://{stack.engine_http}")
    code, verdicts, out = doctor(*stack.args(), "--gateways", gw)
    assert code == 1, out
    assert failing(verdicts) == {f"gateway {gw}"}, out
    assert "ghost" in out and "--replica-id" in out, out


def test_missing_admin_token_fails_probe_and_events(stack: Stack) -> None:
    code, verdicts, out = doctor(*stack.args(token=False))
    assert code == 1, out
    assert verdicts["probe tenant"] == "FAIL" and verdicts["events flowing"] == "FAIL", out
    assert "401" in out and "--admin-token-file" in out, out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--server-http", "ftp://x"], "--server-http"),
        (["--replay-endpoint", "tcp://127.0.0.1:1"], "--replay-endpoint needs --engine-endpoint"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--subscribers", "http://a:1,nope"], "--subscribers"),
        (["--server", "nohostport"], "--server"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args: list[str], message: str) -> None:
    res = run_cli(["doctor", *args])
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_adapter_ids_without_names_fail_lora(stack: Stack) -> None:
    """An engine older than vLLM 0.14 sends lora_id without lora_name: a subscriber without a
    --lora-adapter-names table cannot name it and drops those stores."""
    old = stack.engine("--wire-format", "vllm-0.10.2")
    url = stack.subscribe("r-old", endpoint=old["endpoint"])
    deadline = time.monotonic() + 30
    seed = 200
    while metric(url, "inferencecache_subscriber_lora_drops_total") == 0:  # slow joiner
        assert time.monotonic() < deadline, "the subscriber never dropped an unnamed store"
        seed += 1
        post(f"http://{old['http_address']}/v1/completions",
             {"model": ADAPTER, "prompt": prompt(seed), "max_tokens": 1})  # fmt: skip
        time.sleep(0.2)
    code, verdicts, out = doctor(
        *stack.args(engine=False), "--subscribers", url, "--engine-url",
        f"http://{old['http_address']}", "--engine-endpoint", old["endpoint"],
        "--replay-endpoint", old["replay_endpoint"],
    )
    assert code == 1, out
    assert verdicts["LoRA adapters"] == "FAIL", out
    assert "carry adapter id 1 that subscriber r-old" in out, out
    assert "dropped" in out and "stores of unnamed adapters" in out, out


def test_distrusted_lora_names_without_a_table_fail_lora(stack: Stack) -> None:
    url = stack.subscribe("r-distrust", "--trust-lora-name=false")
    code, verdicts, out = doctor(*stack.args(), "--subscribers", url)
    assert code == 1, out
    assert verdicts["LoRA adapters"] == "FAIL", out
    assert "--trust-lora-name=false and no id for sql-lora" in out, out


def test_replica_silent_longer_than_max_event_age_fails_events_flowing(stack: Stack) -> None:
    code, verdicts, out = doctor(*stack.args(), "--max-event-age", "1ms")
    assert code == 1, out
    assert verdicts["events flowing r0"] == "FAIL", out
    assert all(v.startswith("events flowing ") for v in failing(verdicts)), out
    assert "silent for over 0.001s" in out, out
