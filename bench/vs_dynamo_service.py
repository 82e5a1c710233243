"""Service vs service: Dynamo's standalone indexer vs our ``subscribe`` + ``serve``, each fed by
our ``inferencecache fake-engine`` over ZeroMQ, same events, same queries, same client.

    python bench/vs_dynamo_service.py [--quick | --smoke] [--rounds N] [--json]

Stacks (every process on 127.0.0.1, every one stopped by its own PID):
- **theirs**: ``fake-engine`` (script from stdin, PUB on ``tcp://127.0.0.1:E``) →
  ``python -m dynamo.indexer --block-size B --port P --threads 1 --workers 1=tcp://127.0.0.1:E``
  (it binds 0.0.0.0:P and has no host flag: we only ever query 127.0.0.1:P);
- **ours**: the same fake engine → ``inferencecache subscribe`` → gRPC → ``inferencecache serve``.
Only one stack runs at a time; rounds alternate which goes first.

Events: ``bench/workload.py``'s generator with one worker, encoded once by our wire encoder in
vLLM 0.33's map format (what the fake engine writes), up to 8 events per batch (one scheduler
step), and handed to the engine as ``raw`` script ops, so the engine does no per-block work and
publishes far faster than either indexer ingests (its own rate is reported). The stack is first
made ready with probe batches (ZeroMQ drops what a PUB sends before the SUB has joined) until a
probe answers. Then:

- **ingest** (``service_ingest_speedup_vs_dynamo`` = our blocks/s ÷ theirs): the indexer's
  consumer (Dynamo's indexer; our subscriber) is paused with SIGSTOP, the engine publishes the
  whole workload (ZeroMQ queues it: 100k-message high-water mark), then the consumer is resumed
  and timed until a sentinel of fresh content answers in full, polled every 5 ms (its last
  event re-stores a block removed just before it, so it cannot be applied before any earlier
  event: ``workload.add_sentinel``). This times the indexer, not the
  Python engine (whose own rate, ``service_engine_feed_blocks_per_s``, is ~0.3-2M blocks/s here
  and would share the two cores). Blocks = stored (+ removed) blocks. ``store`` workload: stores
  only; ``evict`` workload (full runs): a capacity that forces evictions.
- **lookup** (``service_lookup_p50_ratio_vs_dynamo`` = our p50 ÷ theirs): the same queries, each
  sent N times at concurrency 1 by h2load (C, in its own process): theirs ``POST /query_by_hash``
  (Dynamo's per-block hashes) over HTTP/1.1, ours ``LookupRoute`` with the chain (our
  fingerprints) over gRPC; also the token form on both (``POST /query`` with ``token_ids`` vs
  ``LookupRoute`` with ``token_ids``). The ratio is the median over (round, query) pairs.
  Transport floors in the same run: an empty ``/query_by_hash`` vs a trivial unary RPC
  (``RenderTemplate`` on a server without ``--template-dir``: ``TEMPLATE_NOT_FOUND`` at once)
  — ``service_*_floor_p50_us``.
  Without h2load a minimal Python client process does the same for both.
- **answers**: every query is also asked once through a Python client and compared with the
  oracle (both sides must be right).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import base64
import collections
import contextlib
import http.client
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import IO, Any

from bench import common
from bench.workload import REMOVED, STORED, Oracle, Params, Workload, add_sentinel, generate
from inferencecache.procs import Children, child_env, free_port

TENANT, MODEL, SCHEME = "bench", "bench-model", "vllm"
WIRE_FORMAT = "vllm-0.33"
EVENTS_PER_BATCH = 8
BATCHES_PER_LINE = 32
MAX_LINE = 60_000
SERVICE = "inferencecache.v1alpha1.InferenceCache"

SHAPES = ("chain", "tokens", "http_chain", "http_tokens")
TPUT_CALLERS = 32
TPUT_QUERIES = 4
STORE = Params(seed=7, workers=1, steps=50_000, capacity=10**9, queries=8, checkpoints=1,
               verify_queries=0)
EVICT = replace(STORE, seed=8, steps=5_000, capacity=3_000)
SMOKE = Params(seed=9, workers=1, steps=300, capacity=200, max_seq_blocks=64, queries=6,
               checkpoints=1, verify_queries=0)

PY_CLIENT = r"""
import http.client, json, sys, time
kind, port, path, body_file, n = sys.argv[1:6]
port, n = int(port), int(n)
body = open(body_file, "rb").read()
if kind == "grpc":
    import grpc
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = ch.unary_unary(path)
    send = lambda: call(body, timeout=30)
else:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    hdr = {"content-type": "application/x-protobuf" if kind == "httpproto"
           else "application/json"}
    def send():
        conn.request("POST", path, body, hdr)
        conn.getresponse().read()
for _ in range(50):
    send()
lat = []
for _ in range(n):
    t0 = time.perf_counter_ns()
    send()
    lat.append((time.perf_counter_ns() - t0) / 1000)
print(json.dumps(lat))
"""


# ---------------------------------------------------------------------------------------------
# Workload → engine script lines


def _events_to_batches(wl: Workload, first_hash_offset: int = 0) -> list[bytes]:
    """Encode the events as vLLM 0.33 map-format EventBatch payloads (several per batch)."""
    from inferencecache.kvevents.encode import (
        WireAllCleared,
        WireEvent,
        WireRemoved,
        WireStored,
        encode_batch,
    )

    eh = wl.engine_hash
    parent = wl.block_parent
    bs = wl.block_size
    out: list[bytes] = []
    step: list[WireEvent] = []
    ts = time.time()  # our index ages holds by this timestamp (TTL): keep it current
    for _worker, kind, ids in wl.events:
        if kind == STORED:
            p = parent[ids[0]]
            toks = [t for b in ids for t in wl.block_tokens[b]]
            step.append(WireStored(
                [eh[b] + first_hash_offset for b in ids],
                eh[p] + first_hash_offset if p >= 0 else None,
                toks, bs, medium="GPU", extra_keys=[None] * len(ids), group_idx=0,
                kv_cache_spec_kind="full_attention"))
        elif kind == REMOVED:
            step.append(WireRemoved([eh[b] + first_hash_offset for b in ids], medium="GPU",
                                    group_idx=0))
        else:
            step.append(WireAllCleared())
        if len(step) >= EVENTS_PER_BATCH:
            out.append(encode_batch(ts, step, WIRE_FORMAT))
            step = []
            ts += 0.001
    if step:
        out.append(encode_batch(ts, step, WIRE_FORMAT))
    return out


def _script_lines(payloads: list[bytes]) -> list[str]:
    """``raw`` script ops, several batches per line; a line stays under the 64 KiB line limit
    of the engine's stdin reader (asyncio's StreamReader)."""
    lines: list[str] = []
    ops: list[dict[str, str]] = []
    size = 0
    for p in payloads:
        op = {"op": "raw", "payload_b64": base64.b64encode(p).decode()}
        n = len(op["payload_b64"]) + 40
        if ops and (size + n > MAX_LINE or len(ops) >= BATCHES_PER_LINE):
            lines.append(json.dumps({"ops": ops}) + "\n")
            ops, size = [], 0
        ops.append(op)
        size += n
    if ops:
        lines.append(json.dumps({"ops": ops}) + "\n")
    return lines


@dataclass
class Query:
    blocks: list[int]
    tokens: list[int]
    fingerprints: list[bytes]
    local_hashes: list[int]  # Dynamo's, as i64


def _queries(wl: Workload, paths: list[list[int]], local: list[list[int]]) -> list[Query]:
    from inferencecache import fingerprint

    out = []
    for path, lh in zip(paths, local, strict=True):
        toks = [t for b in path for t in wl.block_tokens[b]]
        fps = fingerprint.split_packed(fingerprint.chain_packed(toks, wl.block_size))
        out.append(Query(path, toks, fps, [h - (1 << 64) if h >= 1 << 63 else h for h in lh]))
    return out


# ---------------------------------------------------------------------------------------------
# Stacks


class _Drain:
    """Reads a child's JSON-lines stderr; keeps the tail, hands matching records to waiters."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.tail: list[str] = []
        self._counts: collections.Counter[str] = collections.Counter()
        threading.Thread(target=self._run, args=(stream,), daemon=True).start()

    def _run(self, stream: IO[str] | None) -> None:
        assert stream is not None
        with contextlib.suppress(OSError, ValueError):
            for line in stream:
                self.tail = [*self.tail[-20:], line.rstrip()]
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    self._counts[str(rec.get("msg"))] += 1
                    self.lines.put(rec)
        self.lines.put(None)

    def count(self, msg: str) -> int:
        """Records seen so far whose ``msg`` is ``msg``."""
        return self._counts[msg]

    def wait_for(self, msg: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                rec = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if rec is None:
                raise RuntimeError(f"process exited before {msg!r}: {' | '.join(self.tail[-5:])}")
            if rec.get("msg") == msg:
                return rec
        raise RuntimeError(f"no {msg!r} within {timeout}s: {' | '.join(self.tail[-5:])}")


class Stack:
    """An engine plus an indexer service; subclasses know how to start and ask the indexer."""

    name = ""

    def __init__(self, procs: Children, block_size: int, tmp: Path) -> None:
        self.feed_s = float("nan")
        self.procs = procs
        self.block_size = block_size
        self.tmp = tmp
        self.engine_port = free_port()
        self.engine = procs.popen(
            [sys.executable, "-m", "inferencecache.cli", "fake-engine",
             "--bind", f"tcp://127.0.0.1:{self.engine_port}", "--http-address", "",
             "--mode", "script", "--script", "-", "--block-size", str(block_size),
             "--wire-format", WIRE_FORMAT],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=child_env(), cwd=common.REPO)
        self.engine_log = _Drain(self.engine.stderr)
        self.engine_log.wait_for("fake engine ready")

    def send_lines(self, lines: list[str]) -> None:
        assert self.engine.stdin is not None
        for line in lines:
            self.engine.stdin.write(line)
        self.engine.stdin.flush()

    # subclass API
    def matched_blocks(self, q: Query) -> int:
        raise NotImplementedError

    def latency_target(self, shape: str, q: Query) -> tuple[str, int, str, bytes]:
        """(client kind "grpc"|"http"|"httpproto", port, path, body) of one query. Shapes:
        ``floor``, ``chain`` and ``tokens`` on each side's own API (gRPC for ours),
        ``http_chain`` and ``http_tokens`` over HTTP on both sides (ours: the HTTP lookup
        listener, ``/v1/lookup`` with a protobuf body and Dynamo's own ``/query``)."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    # shared
    def make_ready(self, probe_seed: int, timeout: float = 60.0) -> None:
        """Publish fresh probe batches until one is visible (the SUB has joined)."""
        from inferencecache.kvevents.encode import WireStored, encode_batch

        rnd = random.Random(probe_seed)
        bs = self.block_size
        deadline = time.monotonic() + timeout
        i = 0
        while time.monotonic() < deadline:
            toks = [rnd.randrange(100_000, 128_000) for _ in range(4 * bs)]
            hashes: list[int | bytes] = [(1 << 62) + probe_seed * 1000 + i * 4 + k
                                         for k in range(4)]
            payload = encode_batch(time.time(), [WireStored(hashes, None, toks, bs, medium="GPU",
                                                      extra_keys=[None] * 4, group_idx=0,
                                                      kv_cache_spec_kind="full_attention")],
                                   WIRE_FORMAT)
            self.send_lines(_script_lines([payload]))
            i += 1
            q = Query([], toks, [], [])
            t_end = time.monotonic() + 0.5
            while time.monotonic() < t_end:
                with contextlib.suppress(OSError, RuntimeError, http.client.HTTPException):
                    if self.matched_tokens_of_tokens(toks) == 4 * bs:
                        return
                time.sleep(0.02)
            del q
        raise RuntimeError(f"{self.name}: stack not ready in {timeout}s")

    def matched_tokens_of_tokens(self, toks: list[int]) -> int:
        raise NotImplementedError

    def consumer(self) -> subprocess.Popen[Any]:
        """The process whose ZeroMQ SUB reads the engine (paused while the backlog builds)."""
        raise NotImplementedError

    def ingest(self, lines: list[str], final: Query, timeout: float = 600.0) -> float:
        """Seconds for the indexer to take in a backlog of ``lines`` (all published while its
        consumer was stopped), until the sentinel (``final``) answers in full.

        Why a backlog: the Python fake engine publishes ~0.3-2M blocks/s here and shares the two
        cores; timing a live feed would partly time the engine. ``self.feed_s`` records how long
        the engine took to publish everything (reported as its own rate).
        """
        want = len(final.blocks)
        consumer = self.consumer()
        before = self.engine_log.count("script step")
        os.kill(consumer.pid, signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            self.send_lines(lines)
            deadline = t0 + timeout
            while self.engine_log.count("script step") < before + len(lines):
                if self.engine.poll() is not None or time.perf_counter() > deadline:
                    raise RuntimeError(f"{self.name}: the engine failed: "
                                       f"{' | '.join(self.engine_log.tail[-3:])}")
                time.sleep(0.005)
            self.feed_s = time.perf_counter() - t0
        finally:
            os.kill(consumer.pid, signal.SIGCONT)
        t0 = time.perf_counter()
        deadline = t0 + timeout
        while True:
            with contextlib.suppress(OSError, RuntimeError, http.client.HTTPException):
                if self.matched_blocks(final) >= want:
                    break
            if consumer.poll() is not None:
                raise RuntimeError(f"{self.name}: the consumer exited")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.name}: ingest incomplete after {timeout}s")
            time.sleep(0.005)
        return time.perf_counter() - t0


class Theirs(Stack):
    name = "dynamo"

    def __init__(self, procs: Children, block_size: int, tmp: Path, peer_py: Path) -> None:
        super().__init__(procs, block_size, tmp)
        self.port = free_port("0.0.0.0")  # it binds 0.0.0.0:PORT; we query 127.0.0.1
        self.proc = procs.popen(
            [str(peer_py), "-m", "dynamo.indexer", "--block-size", str(block_size),
             "--port", str(self.port), "--threads", "1",
             "--workers", f"1=tcp://127.0.0.1:{self.engine_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=child_env({"DYN_LOG": "error"}), cwd=tmp)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        deadline = time.monotonic() + 60
        while True:
            try:
                self._get("/workers")
                break
            except (OSError, http.client.HTTPException):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("dynamo.indexer did not come up") from None
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                time.sleep(0.1)

    def _get(self, path: str) -> Any:
        self.conn.request("GET", path)
        return json.loads(self.conn.getresponse().read())

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            self.conn.request("POST", path, json.dumps(body),
                              {"content-type": "application/json"})
            resp = self.conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            raise
        if resp.status != 200:
            raise RuntimeError(f"dynamo {path}: HTTP {resp.status}: {data[:200]!r}")
        return json.loads(data)

    @staticmethod
    def _tokens(rep: Any) -> int:
        return max((int(v) for dp in rep.get("scores", {}).values() for v in dp.values()),
                   default=0)

    def matched_tokens_of_tokens(self, toks: list[int]) -> int:
        return self._tokens(self._post("/query", {"token_ids": toks, "model_name": "default"}))

    def matched_blocks(self, q: Query) -> int:
        rep = self._post("/query_by_hash", {"block_hashes": q.local_hashes,
                                            "model_name": "default"})
        return self._tokens(rep) // self.block_size

    def latency_target(self, shape: str, q: Query) -> tuple[str, int, str, bytes]:
        if shape == "floor":  # the cheapest POST route: an empty query
            return "http", self.port, "/query_by_hash", json.dumps(
                {"block_hashes": [], "model_name": "default"}).encode()
        if shape in ("chain", "http_chain"):
            body = {"block_hashes": q.local_hashes, "model_name": "default"}
            return "http", self.port, "/query_by_hash", json.dumps(body).encode()
        body = {"token_ids": q.tokens, "model_name": "default"}
        return "http", self.port, "/query", json.dumps(body).encode()

    def consumer(self) -> subprocess.Popen[Any]:
        return self.proc

    def close(self) -> None:
        self.conn.close()


class Ours(Stack):
    name = "ours"

    def __init__(self, procs: Children, block_size: int, tmp: Path) -> None:
        super().__init__(procs, block_size, tmp)
        policy = tmp / "policy.json"
        policy.write_text(json.dumps({"policies": [{
            "tenant_id": TENANT, "minimum_matched_tokens": 0, "routing_floor_score": 0,
            "affinity_routing": False}]}))
        self.serve = procs.popen(
            [sys.executable, "-m", "inferencecache.cli", "serve",
             "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
             "--lookup-http-address", "127.0.0.1:0",
             "--block-size", str(block_size), "--max-holds", "0", "--sweep-interval", "1h",
             "--policy-file", str(policy)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=child_env(), cwd=common.REPO)
        rec = _Drain(self.serve.stderr).wait_for("serving")
        self.port = int(str(rec["grpc_address"]).rsplit(":", 1)[1])
        self.http_port = int(str(rec["lookup_http_address"]).rsplit(":", 1)[1])
        self.sub = procs.popen(
            [sys.executable, "-m", "inferencecache.cli", "subscribe",
             "--replica-id", "w0", "--model-id", MODEL, "--tenant-id", TENANT,
             "--hash-scheme", SCHEME, "--block-size", str(block_size),
             "--engine-endpoint", f"tcp://127.0.0.1:{self.engine_port}",
             "--server", f"127.0.0.1:{self.port}", "--engine-metrics-url", "",
             "--metrics-address", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=child_env(), cwd=common.REPO)
        self.sub_log = _Drain(self.sub.stderr)
        import grpc

        from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.InferenceCacheStub(self.channel)  # type: ignore[no-untyped-call]

    def _lookup(self, **kw: Any) -> int:
        from inferencecache.v1alpha1 import inferencecache_pb2 as pb

        resp = self.stub.LookupRoute(pb.LookupRouteRequest(
            model_id=MODEL, tenant_id=TENANT, hash_scheme=SCHEME, **kw), timeout=10)
        if resp.reason_code != "PREFIX_MATCH":
            return 0
        return max((s.matched_tokens for s in resp.replica_scores), default=0)

    def matched_tokens_of_tokens(self, toks: list[int]) -> int:
        return self._lookup(token_ids=toks)

    def matched_blocks(self, q: Query) -> int:
        n = len(q.fingerprints)
        return self._lookup(block_hashes=q.fingerprints,
                            block_token_counts=[self.block_size] * n) // self.block_size

    def latency_target(self, shape: str, q: Query) -> tuple[str, int, str, bytes]:
        from inferencecache.v1alpha1 import inferencecache_pb2 as pb

        if shape == "floor":  # a trivial unary RPC (an unimplemented stub): the transport alone
            return "grpc", self.port, f"/{SERVICE}/RenderTemplate", \
                pb.RenderTemplateRequest().SerializeToString()
        if shape == "http_tokens":  # Dynamo's own request shape, on our HTTP listener
            body = {"token_ids": q.tokens, "model_name": MODEL, "tenant_id": TENANT}
            return "http", self.http_port, "/query", json.dumps(body).encode()
        if shape in ("chain", "http_chain"):
            req = pb.LookupRouteRequest(model_id=MODEL, tenant_id=TENANT, hash_scheme=SCHEME,
                                        block_hashes=q.fingerprints,
                                        block_token_counts=[self.block_size] * len(q.blocks))
            if shape == "http_chain":
                return "httpproto", self.http_port, "/v1/lookup", req.SerializeToString()
        else:
            req = pb.LookupRouteRequest(model_id=MODEL, tenant_id=TENANT, hash_scheme=SCHEME,
                                        token_ids=q.tokens)
        return "grpc", self.port, f"/{SERVICE}/LookupRoute", req.SerializeToString()

    def consumer(self) -> subprocess.Popen[Any]:
        return self.sub

    def close(self) -> None:
        self.channel.close()


# ---------------------------------------------------------------------------------------------
# Latency client


def _latencies(kind: str, port: int, path: str, body: bytes, n: int, tmp: Path,
               client: str) -> list[float]:
    """Per-request µs of ``n`` requests at concurrency 1 (after a warm-up)."""
    body_file = tmp / f"body-{kind}-{port}.bin"
    if client == "h2load":
        framed = b"\x00" + len(body).to_bytes(4, "big") + body if kind == "grpc" else body
        body_file.write_bytes(framed)
        ctype = {"grpc": "application/grpc", "httpproto": "application/x-protobuf"}.get(
            kind, "application/json")
        base = ["h2load", "-t", "1", "-c", "1", "-m", "1", "-d", str(body_file),
                "-H", f"content-type: {ctype}"]
        if kind == "grpc":
            base += ["-H", "te: trailers"]
        else:
            base += ["--h1"]
        url = f"http://127.0.0.1:{port}{path}"
        subprocess.run([*base, "-n", str(max(50, n // 10)), url], check=True,
                       capture_output=True, timeout=300)
        log_file = tmp / "h2load.log"
        log_file.unlink(missing_ok=True)
        subprocess.run([*base, "-n", str(n), "--log-file", str(log_file), url], check=True,
                       capture_output=True, timeout=600)
        out = []
        for line in log_file.read_text().splitlines():
            cols = line.split("\t")
            if len(cols) >= 3 and cols[1] == "200":
                out.append(float(cols[2]))
        if len(out) < n * 0.99:
            raise RuntimeError(f"h2load {path}: only {len(out)} of {n} requests succeeded")
        return out
    body_file.write_bytes(body)
    res = subprocess.run([sys.executable, "-c", PY_CLIENT, kind, str(port), path,
                          str(body_file), str(n)], check=True, capture_output=True, text=True,
                         timeout=900, env=child_env())
    values: list[float] = json.loads(res.stdout)
    return values


def _throughput(kind: str, port: int, path: str, body: bytes, n: int, conc: int,
                tmp: Path) -> float:
    """Requests/s of ``n`` HTTP/1.1 requests from ``conc`` keep-alive connections (h2load)."""
    body_file = tmp / f"tput-{port}.bin"
    body_file.write_bytes(body)
    ctype = "application/x-protobuf" if kind == "httpproto" else "application/json"
    cmd = ["h2load", "--h1", "-t", "1", "-c", str(conc), "-d", str(body_file),
           "-H", f"content-type: {ctype}", f"http://127.0.0.1:{port}{path}"]
    subprocess.run([*cmd, "-n", str(max(conc, n // 10))], check=True,
                   capture_output=True, timeout=300)  # warm-up
    res = subprocess.run([*cmd, "-n", str(n)], check=True, capture_output=True,
                         text=True, timeout=600)
    ok = re.search(r"(\d+) succeeded", res.stdout)
    rate = re.search(r"finished in [^,]+, ([\d.]+) req/s", res.stdout)
    if ok is None or rate is None or int(ok.group(1)) < n * 0.99:
        raise RuntimeError(f"h2load {path}: {res.stdout[-300:]}")
    return float(rate.group(1))


# ---------------------------------------------------------------------------------------------
# The driver


@contextlib.contextmanager
def _stack(side: str, procs: Children, bs: int, tmp: Path,
           peer_py: Path | None, probe_seed: int) -> Iterator[Stack]:
    sub = tmp / f"{side}-{probe_seed}"
    sub.mkdir()
    with Children() as mine:
        st: Stack = Theirs(mine, bs, sub, peer_py) if side == "dynamo" and peer_py else \
            Ours(mine, bs, sub)
        try:
            st.make_ready(probe_seed)
            yield st
        finally:
            st.close()


def _prepare(p: Params, peer: common.Worker | None) -> tuple[Workload, list[str], list[Query],
                                                             Query, list[dict[int, int]], int]:
    wl = generate(p)
    path = add_sentinel(wl)  # completion = this fresh last sequence answers in full
    lines = _script_lines(_events_to_batches(wl))
    oracle = Oracle(wl)
    oracle.apply_until(len(wl.events))
    paths = [*wl.queries, path]
    if peer is not None:
        seqs = [[t for b in q for t in wl.block_tokens[b]] for q in paths]
        local = peer.call({"op": "hash", "block_size": wl.block_size, "seqs": seqs})["hashes"]
    else:
        local = [[] for _ in paths]
    qs = _queries(wl, paths, local)
    blocks = sum(len(ids) for _w, k, ids in wl.events if k in (STORED, REMOVED))
    return wl, lines, qs[:-1], qs[-1], oracle.answers(wl.queries), blocks


def run(quick: bool = False, *, smoke: bool = False, rounds: int | None = None,
        peer: bool = True, client: str | None = None, evict: bool | None = None,
        requests: int | None = None) -> dict[str, Any]:
    """Service comparison; keys ``service_*``. Raises AssertionError on a wrong answer."""
    n_rounds = rounds if rounds is not None else (1 if smoke else 3 if quick else 5)
    n_req = requests if requests is not None else (0 if smoke else 300 if quick else 1000)
    n_tput = 5_000 if quick else 20_000
    client = client or ("h2load" if shutil.which("h2load") else "python")
    workloads = {"store": SMOKE if smoke else STORE}
    if evict if evict is not None else not (quick or smoke):
        workloads["evict"] = EVICT
    peer_py = common.ensure_peer_venv() if peer else None
    out: dict[str, Any] = {"service_client": client, "service_rounds": n_rounds,
                           "service_wire_format": WIRE_FORMAT}
    errors: list[str] = []
    sides = ["ours", "dynamo"] if peer_py is not None else ["ours"]
    with Children() as procs, tempfile.TemporaryDirectory(prefix="bench-svc-") as tmpdir:
        tmp = Path(tmpdir)
        hasher = (common.Worker(procs, [str(peer_py), str(common.BENCH_DIR / "peer_dynamo.py")],
                                "dynamo-hash", env=child_env({"DYN_LOG": "error"}))
                  if peer_py is not None else None)
        prepared = {name: _prepare(p, hasher) for name, p in workloads.items()}
        if hasher is not None:
            hasher.close()
        ingest: dict[str, dict[str, list[float]]] = {
            w: {s: [] for s in sides} for w in workloads}
        lat: dict[str, dict[str, list[float]]] = {
            shape: {s: [] for s in sides} for shape in SHAPES}
        pair_ratios: dict[str, list[float]] = {shape: [] for shape in SHAPES}
        tput: dict[str, list[float]] = {s: [] for s in sides}
        feed: dict[str, list[float]] = {w: [] for w in workloads}
        floor: dict[str, list[float]] = {s: [] for s in sides}
        probe = 1
        for r in range(n_rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            p50s: dict[str, dict[str, list[float]]] = {shape: {} for shape in SHAPES}
            for wname, (wl, lines, qs, final, want, blocks) in prepared.items():
                for side in order:
                    common.log(f"service: round {r + 1}/{n_rounds}, {wname} workload, {side}")
                    probe += 1
                    with _stack(side, procs, wl.block_size, tmp, peer_py, probe) as st:
                        secs = st.ingest(lines, final)
                        ingest[wname][side].append(blocks / secs)
                        feed[wname].append(blocks / st.feed_s)
                        out.setdefault("service_ingest_seconds", []).append(round(secs, 3))
                        for i, q in enumerate(qs):
                            got = st.matched_blocks(q)
                            exp = want[i].get(0, 0)
                            if got != exp:
                                errors.append(f"{side}/{wname}: query {i}: {got} blocks, "
                                              f"oracle {exp}")
                        if wname != "store" or not n_req:
                            continue
                        kind, port, path, body = st.latency_target("floor", qs[0])
                        floor[side].extend(_latencies(kind, port, path, body, n_req, tmp, client))
                        if client == "h2load":  # lookups/s at 32 callers, HTTP on both sides
                            rates = []
                            for q in qs[:TPUT_QUERIES]:
                                kind, port, path, body = st.latency_target("http_chain", q)
                                rates.append(_throughput(kind, port, path, body, n_tput,
                                                         TPUT_CALLERS, tmp))
                            tput[side].append(common.median(rates))
                        for shape in SHAPES:
                            per_q = []
                            for q in qs:
                                kind, port, path, body = st.latency_target(shape, q)
                                us = _latencies(kind, port, path, body, n_req, tmp, client)
                                lat[shape][side].extend(us)
                                per_q.append(common.percentile(us, 0.5))
                            p50s[shape][side] = per_q
            if len(sides) == 2:
                for shape, d in p50s.items():
                    if len(d) == 2:
                        pair_ratios[shape] += [a / b for a, b in zip(d["ours"], d["dynamo"],
                                                                    strict=True)]
    for wname, d in ingest.items():
        if smoke:
            break  # correctness only: tiny runs say nothing about speed
        suffix = "" if wname == "store" else "_evicting"
        for side, vals in d.items():
            out[f"service_{side}_ingest_blocks_per_s{suffix}"] = common.rounded(
                common.median(vals), 0)
        out[f"service_engine_feed_blocks_per_s{suffix}"] = common.rounded(
            max(feed[wname], default=float("nan")), 0)
        if len(d) == 2 and d["dynamo"]:
            out[f"service_ingest_speedup_vs_dynamo{suffix}"] = common.rounded(common.median(
                [a / b for a, b in zip(d["ours"], d["dynamo"], strict=True)]))
    for shape, d in lat.items():
        for side, vals in d.items():
            if vals:
                out[f"service_{side}_lookup_{shape}_p50_us"] = common.rounded(
                    common.percentile(vals, 0.5), 1)
                out[f"service_{side}_lookup_{shape}_p99_us"] = common.rounded(
                    common.percentile(vals, 0.99), 1)
    for side, vals in floor.items():
        if vals:
            out[f"service_{side}_floor_p50_us"] = common.rounded(common.percentile(vals, 0.5), 1)
    if pair_ratios["chain"]:
        out["service_lookup_p50_ratio_vs_dynamo"] = common.rounded(
            common.median(pair_ratios["chain"]))
        out["service_lookup_tokens_p50_ratio_vs_dynamo"] = common.rounded(
            common.median(pair_ratios["tokens"]))
        out["http_lookup_p50_ratio_vs_dynamo"] = common.rounded(
            common.median(pair_ratios["http_chain"]))
        out["http_lookup_tokens_p50_ratio_vs_dynamo"] = common.rounded(
            common.median(pair_ratios["http_tokens"]))
    for side, rates in tput.items():
        if rates:
            out[f"service_{side}_http_lookups_per_s_c{TPUT_CALLERS}"] = common.rounded(
                common.median(rates), 0)
    if len(tput) == 2 and tput["dynamo"] and len(tput["ours"]) == len(tput["dynamo"]):
        out["http_lookups_per_s_ratio_vs_dynamo"] = common.rounded(common.median(
            [a / b for a, b in zip(tput["ours"], tput["dynamo"], strict=True)]))
    st_ = prepared["store"][0].stats()
    out["service_workload"] = {"events": st_["events"], "stored_blocks": st_["stored_blocks"],
                               "script_lines": len(prepared["store"][1]),
                               "queries": len(prepared["store"][2]),
                               "query_blocks_mean": round(st_["query_blocks_mean"], 1)}
    out["service_peer"] = (f"{common.DYNAMO_PACKAGE}=={common.DYNAMO_VERSION}"
                           if peer_py is not None else None)
    out["service_correct"] = not errors
    out["service_errors"] = errors[:20]
    if errors:
        raise AssertionError("vs_dynamo_service: wrong answers:\n" + "\n".join(errors[:20]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None, help="requests per query and side")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--evict", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--client", choices=("h2load", "python"), default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with common.sigterm_as_exit():
        res = run(args.quick, smoke=args.smoke, rounds=args.rounds, peer=not args.no_peer,
                  client=args.client, evict=args.evict, requests=args.requests)
    common.print_figures(res, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
