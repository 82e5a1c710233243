"""The gateway in front of real simulated engines, real subscribers and the real server.

Processes: ``serve``, two ``fake-engine --mode simulated`` (OpenAI API + KV events, the tiny
test tokenizer, one LoRA adapter), one ``subscribe`` per engine, and ``gateway``; every one is
started on ports chosen at run time and stopped by its own PID in teardown. A replica is warmed
by sending a prompt straight to its engine; once its subscriber's report reached the index
(LookupRoute answers PREFIX_MATCH for that replica) the same prompt sent through the gateway must
land there and hit the engine's cache. Prompts are several blocks long and warmed on one replica
only (the server's 64-token floor and its "held by every replica scores 0" rule).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferencecache import fingerprint
from inferencecache.procs import Child, Children
from inferencecache.tokenize.openai import (
    chat_prompt_ids,
    completion_prompt_ids,
    load_engine_tokenizers,
)
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.tokenize.tinytok import write_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "m"
ADAPTER = "sql-lora"
BLOCK = 16


@dataclass
class Cluster:
    tokdir: Path
    children: Children = field(default_factory=Children)
    grpc_address: str = ""
    engines: dict[str, str] = field(default_factory=dict)  # replica -> http host:port
    engine_procs: dict[str, Child] = field(default_factory=dict)
    stub: Any = None
    channel: grpc.Channel | None = None

    def start(self, *args: str) -> Child:
        return self.children.start(*args)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.children.stop_all()

    def gateway(self, *extra: str) -> str:
        engines = ",".join(f"{rid}=http://{addr}" for rid, addr in sorted(self.engines.items()))
        p = self.start(
            "gateway", "--engines", engines, "--server", self.grpc_address,
            "--http-address", "127.0.0.1:0", "--block-size", str(BLOCK),
            "--tokenizer-dir", str(self.tokdir), "--health-interval", "500ms", *extra,
        )
        return str(p.wait_log("serving", timeout=30)["http_address"])

    def lookup(self, ids: list[int], adapter: str = "") -> tuple[str, list[str]]:
        hashes, counts = fingerprint.chain(ids, BLOCK)
        resp = self.stub.LookupRoute(
            pb.LookupRouteRequest(
                model_id=MODEL, tenant_id="default", hash_scheme="vllm", adapter_id=adapter,
                block_hashes=hashes, block_token_counts=counts,
            ),
            timeout=5,
        )
        return resp.reason_code, [s.replica_id for s in resp.replica_scores]

    def wait_indexed(self, ids: list[int], replica: str, adapter: str = "") -> None:
        deadline = time.monotonic() + 30
        while True:
            got = self.lookup(ids, adapter)
            if got == ("PREFIX_MATCH", [replica]):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"index never showed {replica} holding the prompt: {got}")
            time.sleep(0.05)


def http(url: str, body: Any | None = None) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, dict(r.headers), json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tokdir = tmp_path_factory.mktemp("tok")
    write_model(tokdir, MODEL, with_bos_post_processor=True)
    c = Cluster(tokdir)
    try:
        rec = c.start(
            "serve", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--block-size", str(BLOCK),
        ).wait_log("serving", timeout=30)
        c.grpc_address = rec["grpc_address"]
        c.channel = grpc.insecure_channel(c.grpc_address)
        c.stub = pb_grpc.InferenceCacheStub(c.channel)  # type: ignore[no-untyped-call]
        for rid in ("r0", "r1"):
            eng = c.start(
                "fake-engine", "--mode", "simulated", "--bind", "tcp://127.0.0.1:0",
                "--http-address", "127.0.0.1:0", "--block-size", str(BLOCK),
                "--model-name", MODEL, "--tokenizer-dir", str(tokdir),
                "--lora-adapters", f"1={ADAPTER}", "--gpu-blocks", "1024",
                "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "0.1",
            )
            ready = eng.wait_log("simulated engine ready", timeout=30)
            c.engines[rid] = ready["http_address"]
            c.engine_procs[rid] = eng
            sub = c.start(
                "subscribe", "--replica-id", rid, "--model-id", MODEL,
                "--engine-endpoint", ready["endpoint"], "--server", c.grpc_address,
                "--metrics-address", "127.0.0.1:0", "--window", "20ms",
                "--block-size", str(BLOCK), "--lora-adapter-names", f"1={ADAPTER}",
                "--engine-metrics-url", f"http://{ready['http_address']}/metrics",
                "--stats-interval", "1s",
            )
            # events the engine publishes before the SUB socket connected are lost (ZeroMQ)
            sub.wait_log("connected to the engine", timeout=30)
        yield c
    finally:
        c.close()


def text(seed: int) -> str:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    return " ".join(words[(seed * 7 + i * 3) % len(words)] + str(seed) for i in range(60))


def test_completion_text_routes_to_the_warm_engine_and_hits(cluster: Cluster) -> None:
    toks = load_engine_tokenizers(cluster.tokdir)
    prompt = text(1)
    ids = completion_prompt_ids(toks[MODEL], {"prompt": prompt})
    assert len(ids) >= 5 * BLOCK
    status, _, _ = http(f"http://{cluster.engines['r1']}/v1/completions",
                        {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert status == 200
    cluster.wait_indexed(ids, "r1")
    gw = cluster.gateway()
    for _ in range(3):
        status, headers, body = http(f"http://{gw}/v1/completions",
                                     {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert status == 200
        assert headers["X-Cache-Route-Reason"] == "PREFIX_MATCH"
        assert headers["X-Cache-Route-Replica"] == "r1"
        assert headers["X-Cache-Route-Prompt-Tokens"] == str(len(ids))
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(ids) // BLOCK * BLOCK - BLOCK  # the engine really hit


def test_chat_routes_to_the_warm_engine(cluster: Cluster) -> None:
    toks = load_engine_tokenizers(cluster.tokdir)
    body = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": text(2)}, {"role": "user", "content": text(3)}]}
    ids = chat_prompt_ids(toks[MODEL], body)
    status, _, _ = http(f"http://{cluster.engines['r0']}/v1/chat/completions", body)
    assert status == 200
    cluster.wait_indexed(ids, "r0")
    gw = cluster.gateway()
    status, headers, _ = http(f"http://{gw}/v1/chat/completions", body)
    assert status == 200
    assert (headers["X-Cache-Route-Reason"], headers["X-Cache-Route-Replica"]) == (
        "PREFIX_MATCH", "r0")


def test_lora_adapter_partition_routes_separately(cluster: Cluster) -> None:
    ids = list(range(3000, 3000 + 6 * BLOCK))
    assert http(f"http://{cluster.engines['r1']}/v1/completions",
                {"model": ADAPTER, "prompt": ids, "max_tokens": 1})[0] == 200
    assert http(f"http://{cluster.engines['r0']}/v1/completions",
                {"model": MODEL, "prompt": ids, "max_tokens": 1})[0] == 200
    cluster.wait_indexed(ids, "r1", adapter=ADAPTER)
    cluster.wait_indexed(ids, "r0")
    gw = cluster.gateway()
    _, headers, _ = http(f"http://{gw}/v1/completions",
                         {"model": ADAPTER, "prompt": ids, "max_tokens": 1})
    assert (headers["X-Cache-Route-Reason"], headers["X-Cache-Route-Replica"]) == (
        "PREFIX_MATCH", "r1")
    _, headers, _ = http(f"http://{gw}/v1/completions",
                         {"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert (headers["X-Cache-Route-Reason"], headers["X-Cache-Route-Replica"]) == (
        "PREFIX_MATCH", "r0")


def test_streaming_through_the_gateway(cluster: Cluster) -> None:
    gw = cluster.gateway()
    req = urllib.request.Request(
        f"http://{gw}/v1/completions",
        data=json.dumps({"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 4,
                         "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in r.read().split(b"\n\n") if e.strip()]
    assert events[-1].strip() == b"data: [DONE]"
    assert len(events) >= 2


def test_oracle_policy_sees_the_engines_caches(cluster: Cluster) -> None:
    ids = list(range(7000, 7000 + 8 * BLOCK))
    assert http(f"http://{cluster.engines['r0']}/v1/completions",
                {"model": MODEL, "prompt": ids, "max_tokens": 1})[0] == 200
    gw = cluster.gateway("--routing-policy", "oracle")
    _, headers, _ = http(f"http://{gw}/v1/completions",
                         {"model": MODEL, "prompt": ids + [1] * 10, "max_tokens": 1})
    assert (headers["X-Cache-Route-Reason"], headers["X-Cache-Route-Replica"]) == (
        "ORACLE_PREFIX", "r0")
    assert headers["X-Cache-Route-Matched-Tokens"] == str(len(ids))


def test_a_crashed_engine_is_skipped(cluster: Cluster) -> None:
    """Runs last in this module: it kills r1."""
    gw = cluster.gateway("--routing-policy", "round_robin")
    cluster.engine_procs["r1"].kill()
    replicas = []
    for i in range(6):
        status, headers, _ = http(f"http://{gw}/v1/completions",
                                  {"model": MODEL, "prompt": [i] * 20, "max_tokens": 1})
        assert status == 200
        replicas.append(headers["X-Cache-Route-Replica"])
    assert set(replicas) == {"r0"}
    status, _, health = http(f"http://{gw}/healthz")
    assert status == 200 and health["engines"]["r1"]["healthy"] is False
