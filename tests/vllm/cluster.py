"""The whole path on loopback around two real vLLM engines.

``serve`` (block size 32, the tiny model's tokenizer), engine A (LoRA ``sql-lora``, runtime
adapter loading, a replay endpoint, core 0) and engine B (a 48-block cache so it evicts, core 1),
one ``subscribe`` per engine, and later the gateway. KV events travel over ``ipc://`` sockets in
the test's temp dir (vLLM binds ipc endpoints, so nothing listens beyond loopback). Assertions go
through ``LookupRoute`` with the prompt's ``token_ids``, computed by ``inferencecache.tokenize``
from the model's own tokenizer files and checked against the engine's ``/tokenize``.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from inferencecache.procs import Child, Children
from inferencecache.tokenize.openai import (
    EngineTokenizer,
    completion_prompt_ids,
    load_engine_tokenizers,
)
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.vllm.engine import BLOCK, MODEL_NAME, VllmAssets, VllmEngine, http_json

INDEX_WAIT_S = 20.0  # engine step -> ZeroMQ -> subscriber (100 ms window) -> gRPC -> index
ADAPTER_POLL_S = 1.0  # the subscribers' --adapter-poll-interval (GET <engine>/v1/models)
SMALL_CACHE_BLOCKS = 48  # engine B: 1,536 tokens, so a few long prompts evict older ones
WORDS = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
    "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango",
    "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "cache", "prefix", "route", "block",
    "engine", "token", "quick", "brown", "fox", "lazy", "dog", "hello", "world",
]


def full_blocks(n_tokens: int) -> int:
    """Tokens in the full blocks of an ``n_tokens`` prompt: what an engine can cache."""
    return n_tokens // BLOCK * BLOCK


@dataclass
class Cluster:
    assets: VllmAssets
    workdir: Path
    tokdir: Path
    tokenizer: EngineTokenizer
    children: Children = field(default_factory=Children)
    engines: dict[str, VllmEngine] = field(default_factory=dict)
    subscribers: dict[str, Child] = field(default_factory=dict)
    sub_metrics: dict[str, str] = field(default_factory=dict)  # replica -> host:port
    grpc_address: str = ""
    http_address: str = ""
    channel: grpc.Channel | None = None
    stub: Any = None
    gateway_address: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # printed with the timings
    _seq: int = 0

    # --- processes -----------------------------------------------------------------------

    def spawn(self, *args: str) -> Child:
        return self.children.start(*args)

    def start_server(self) -> None:
        rec = self.spawn(
            "serve", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--block-size", str(BLOCK), "--tokenizer-dir", str(self.tokdir),
        ).wait_log("serving", timeout=30)
        self.grpc_address, self.http_address = rec["grpc_address"], rec["http_address"]
        self.channel = grpc.insecure_channel(self.grpc_address)
        self.stub = pb_grpc.InferenceCacheStub(self.channel)  # type: ignore[no-untyped-call]

    def post_policy(self, body: dict[str, Any]) -> None:
        status, _, resp = http_json(f"http://{self.http_address}/policy", body, timeout=10)
        assert status == 204, f"/policy answered {status}: {resp}"

    def add_engine(self, engine: VllmEngine, *subscriber_args: str) -> None:
        """Start one engine (bounded), then its subscriber, then prove the path is live."""
        self.engines[engine.name] = engine
        engine.start()
        self.timings[f"engine {engine.name} start"] = engine.wait_ready()
        self.start_subscriber(engine.name, engine, *subscriber_args)
        self.prime(engine.name)

    def start_subscriber(self, replica: str, engine: VllmEngine, *args: str) -> Child:
        """``inferencecache subscribe`` for ``engine`` under replica id ``replica``."""
        sub = self.spawn(
            "subscribe", "--replica-id", replica, "--model-id", MODEL_NAME,
            "--engine-endpoint", engine.events_endpoint, "--server", self.grpc_address,
            "--block-size", str(BLOCK), "--engine-metrics-url", f"{engine.url}/metrics",
            "--engine-models-url", f"{engine.url}/v1/models",
            "--adapter-poll-interval", f"{ADAPTER_POLL_S:g}s",
            "--metrics-address", "127.0.0.1:0", "--stats-interval", "2s", *args,
        )
        self.subscribers[replica] = sub
        self.sub_metrics[replica] = sub.wait_log("metrics listening", timeout=30)["address"]
        return sub

    def prime(self, name: str, timeout: float = 60.0) -> None:
        """Send short unique prompts until one shows up in the index: SUB is connected.

        (A PUB drops what it sends before the subscriber's connection is up.)"""
        deadline = time.monotonic() + timeout
        while True:
            text = self.prompt(f"prime {name}", blocks=3)
            ids = self.serve(name, text)
            with contextlib.suppress(AssertionError):
                self.wait_held(ids, {name: full_blocks(len(ids))}, timeout=5)
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{name}: no KV event reached the index within {timeout:.0f}s; subscriber "
                    "log:\n" + "\n".join(self.subscribers[name].tail(20)))

    def start_gateway(self) -> str:
        if not self.gateway_address:
            engines = ",".join(f"{n}={e.url}" for n, e in sorted(self.engines.items()))
            p = self.spawn(
                "gateway", "--engines", engines, "--server", self.grpc_address,
                "--http-address", "127.0.0.1:0", "--block-size", str(BLOCK),
                "--tokenizer-dir", str(self.tokdir), "--health-interval", "1s",
                # the routing is under test, not the hint's latency: two vLLM engines keep this
                # 2-core machine busy, and the 50 ms default deadline would be a timed assertion
                "--lookup-timeout", "2s",
            )
            self.gateway_address = str(p.wait_log("serving", timeout=30)["http_address"])
        return self.gateway_address

    def close(self) -> None:
        """Stop everything by PID, engines first (they spin their threads while idle)."""
        errors: list[str] = []
        for engine in self.engines.values():
            try:
                engine.stop()
            except Exception as e:  # keep stopping the rest
                errors.append(f"{engine.name}: {e}")
        if self.channel is not None:
            self.channel.close()
        self.children.stop_all()
        assert not errors, errors

    # --- prompts and requests ------------------------------------------------------------

    def prompt(self, tag: str, blocks: int) -> str:
        """A text prompt unique to this call (its first block differs from every other one)
        of exactly ``blocks`` full blocks plus a partial one (which no engine caches)."""
        self._seq += 1
        rng = random.Random(f"{tag}/{self._seq}")
        text = f"[{tag} #{self._seq}]"
        # One word adds a few tokens and never changes the earlier ones (byte-level BPE splits
        # at spaces), so this stops a few tokens into the block after the last full one.
        while len(self.ids(text)) < blocks * BLOCK + 8:
            text += " " + rng.choice(WORDS)
        n = len(self.ids(text))
        assert full_blocks(n) == blocks * BLOCK and n % BLOCK, (tag, n)
        return text

    def ids(self, text: str) -> list[int]:
        """Prompt ids as the gateway computes them (``inferencecache.tokenize``)."""
        return completion_prompt_ids(self.tokenizer, {"prompt": text})

    def serve(self, name: str, text: str, *, model: str = MODEL_NAME,
              max_tokens: int = 2) -> list[int]:
        """A real completion on engine ``name``; returns the prompt ids, checked to be the
        engine's own (``/tokenize`` and ``usage.prompt_tokens``)."""
        engine = self.engines[name]
        ids = self.ids(text)
        assert engine.tokenize(text, model=model) == ids, "our tokenizer disagrees with vLLM"
        body = engine.complete(text, model=model, max_tokens=max_tokens)
        assert body["usage"]["prompt_tokens"] == len(ids)
        return ids

    # --- the index -----------------------------------------------------------------------

    def lookup(self, ids: list[int], adapter: str = "", tenant: str = "default") -> Any:
        return self.stub.LookupRoute(
            pb.LookupRouteRequest(model_id=MODEL_NAME, tenant_id=tenant, hash_scheme="vllm",
                                  adapter_id=adapter, token_ids=ids),
            timeout=5,
        )

    def held(self, ids: list[int], adapter: str = "", tenant: str = "default") -> dict[str, int]:
        """Replica -> matched tokens when the answer is ``PREFIX_MATCH``; else empty."""
        resp = self.lookup(ids, adapter, tenant)
        if resp.reason_code != "PREFIX_MATCH":
            return {}
        return {s.replica_id: s.matched_tokens for s in resp.replica_scores}

    def wait_held(self, ids: list[int], want: dict[str, int] | Callable[[dict[str, int]], bool],
                  *, adapter: str = "", tenant: str = "default",
                  timeout: float = INDEX_WAIT_S) -> dict[str, int]:
        """Poll ``held`` until it equals ``want`` (or ``want(held)`` is true), bounded."""
        ok = want if callable(want) else (lambda got: got == want)
        deadline = time.monotonic() + timeout
        while True:
            got = self.held(ids, adapter, tenant)
            if ok(got):
                return got
            if time.monotonic() > deadline:
                resp = self.lookup(ids, adapter, tenant)
                raise AssertionError(
                    f"index never reached {want} (adapter {adapter!r}) within {timeout:.0f}s: "
                    f"last {resp.reason_code} "
                    f"{[(s.replica_id, s.matched_tokens) for s in resp.replica_scores]}")
            time.sleep(0.05)

    def snapshot(self) -> dict[str, Any]:
        """The server's ``GET /snapshot`` (contract-and-index.md §9.3)."""
        status, _, body = http_json(f"http://{self.http_address}/snapshot", timeout=10)
        assert status == 200, body
        assert isinstance(body, dict)
        return body

    def sub_metric(self, name: str, metric: str, **labels: str) -> float:
        """One sample of subscriber ``name``'s ``inferencecache_subscriber_<metric>``."""
        url = f"http://{self.sub_metrics[name]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        want = f"inferencecache_subscriber_{metric}"
        if labels:
            want += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_sub_metric(self, name: str, metric: str, want: float,
                        timeout: float = INDEX_WAIT_S, **labels: str) -> float:
        """Poll ``sub_metric`` until it reaches ``want``: the subscriber counts a delivered
        event after the RPC returns, which can be after the index already shows its effect."""
        deadline = time.monotonic() + timeout
        while (got := self.sub_metric(name, metric, **labels)) < want:
            if time.monotonic() > deadline:
                raise AssertionError(f"{metric} of {name} stayed at {got}, wanted {want}")
            time.sleep(0.05)
        return got


def make_cluster(assets: VllmAssets, workdir: Path) -> Cluster:
    """Server, engines A and B with their subscribers, started one after the other."""
    tokdir = workdir / "tokenizers"
    tokdir.mkdir()
    # The server and gateway read <dir>/<model id>/tokenizer.json: link to the engine's model
    # folder so both sides read the very same tokenizer files.
    (tokdir / MODEL_NAME).symlink_to(assets.model, target_is_directory=True)
    tokenizer = load_engine_tokenizers(tokdir)[MODEL_NAME]
    c = Cluster(assets, workdir, tokdir, tokenizer)
    try:
        c.start_server()
        # Floor of one block instead of the default 64 tokens, so a single stale block would be
        # seen; the score floor and affinity keep their defaults.
        c.post_policy({"version": 7, "policies": [
            {"namespace": "default", "minimumMatchedTokens": BLOCK}]})
        sock = workdir / "ipc"
        sock.mkdir()
        # One core each (VLLM_CPU_OMP_THREADS_BIND) so the two engines' OpenMP threads do not
        # fight over the same core; a 1-core machine shares it.
        cores = sorted(os.sched_getaffinity(0))
        core_a, core_b = str(cores[0]), str(cores[1 % len(cores)])
        c.add_engine(
            VllmEngine(
                "A", assets, workdir, f"ipc://{sock}/A-events", cpu=core_a,
                replay_endpoint=f"ipc://{sock}/A-replay",
                extra_args=("--enable-lora", "--lora-modules",
                            f"sql-lora={assets.adapter('sql-lora')}",
                            "--max-lora-rank", "8", "--max-loras", "2"),
                extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
            ),
            "--replay-endpoint", f"ipc://{sock}/A-replay",
        )
        c.add_engine(VllmEngine(
            "B", assets, workdir, f"ipc://{sock}/B-events", cpu=core_b,
            extra_args=("--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS)),
        ))
    except BaseException:
        c.close()
        raise
    return c
