"""LookupRoute over gRPC, end to end: a real ``inferencecache serve`` and a separate client process.

    python bench/grpc_lookup.py [--quick] [--json] [--client h2load|python]

Starts ``inferencecache serve`` in its own process, loads N holds (1,000,000; 50,000 with
``--quick``) through ``ReportCacheState`` over 4 replicas, then measures LookupRoute latency at
concurrency 1 and 8 for two request shapes that both answer PREFIX_MATCH over 512 blocks:

- ``chain``: 512 block hashes + 512 counts (what a gateway that fingerprints sends),
- ``tokens``: 8192 ``token_ids`` (Llama-3-sized vocabulary; the server fingerprints them),

plus a trivial unary RPC (``RenderTemplate`` without ``--template-dir``) in the same run as the
transport floor, so ratios survive a noisy machine. The client is h2load (Debian
``nghttp2-client``; C, per-request log) with a prebuilt gRPC-framed body, or a Python grpc client
process when h2load is missing.
``run(quick)`` returns the figures as a dict for bench/run.py.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from inferencecache import fingerprint
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

SERVICE = "inferencecache.v1alpha1.InferenceCache"
TENANT, MODEL, SCHEME = "bench", "bench-model", "vllm"
REPLICAS = 4
TOKENS = 8192
BLOCK = 16
VOCAB = 128_000
ENTRY_BLOCKS = 512  # blocks per PrefixEntry in the load
ENTRIES_PER_UPDATE = 32
ROUNDS = 4  # interleaved rounds of the concurrency-1 measurements

PY_CLIENT = r"""
import json, sys, threading, time
import grpc
target, path, body_file = sys.argv[1:4]
n, conc = int(sys.argv[4]), int(sys.argv[5])
body = open(body_file, "rb").read()
ch = grpc.insecure_channel(target)
call = ch.unary_unary(path)
for _ in range(200):
    call(body, timeout=30)
lat = []
lock = threading.Lock()
per = n // conc
def worker():
    mine = []
    for _ in range(per):
        t0 = time.perf_counter_ns()
        call(body, timeout=30)
        mine.append((time.perf_counter_ns() - t0) / 1000)
    with lock:
        lat.extend(mine)
ts = [threading.Thread(target=worker) for _ in range(conc)]
for t in ts: t.start()
for t in ts: t.join()
print(json.dumps(lat))
"""


STACK_SERVER = r"""
import asyncio, sys
from concurrent import futures
import grpc
kind = sys.argv[1]
def ident(b): return b
def h_sync(req, ctx): return b""
async def h_aio(req, ctx): return b""
def handlers(fn):
    return (grpc.method_handlers_generic_handler("t.T", {"M": grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=ident, response_serializer=ident)}),)
if kind == "sync":
    s = grpc.server(futures.ThreadPoolExecutor(max_workers=256))
    s.add_generic_rpc_handlers(handlers(h_sync))
    print(s.add_insecure_port("127.0.0.1:0"), flush=True)
    s.start()
    s.wait_for_termination()
else:
    import uvloop
    async def main():
        s = grpc.aio.server()
        s.add_generic_rpc_handlers(handlers(h_aio))
        print(s.add_insecure_port("127.0.0.1:0"), flush=True)
        await s.start()
        await s.wait_for_termination()
    uvloop.run(main())
"""
STACKS = ("sync", "aio_uvloop")


def stack_figures(quick: bool, tmp: Path) -> dict[str, float]:
    """The gRPC server stacks grpcio offers, each a trivial unary RPC in its own process,
    measured by h2load at 1 and 32 callers in interleaved rounds (why ``serve`` runs the one
    it runs: docs/server.md "Concurrency")."""
    n = 3_000 if quick else 10_000
    body = tmp / "empty.bin"
    body.write_bytes(_frame(b""))
    res: dict[str, list[float]] = {}
    for _round in range(2 if quick else 3):
        for kind in STACKS:
            proc = subprocess.Popen([sys.executable, "-c", STACK_SERVER, kind.split("_")[0]],
                                    stdout=subprocess.PIPE, text=True)
            try:
                assert proc.stdout is not None
                port = int(proc.stdout.readline())
                url = f"http://127.0.0.1:{port}/t.T/M"
                base = ["h2load", "-t", "1", "-m", "1", "-d", str(body), "-H",
                        "content-type: application/grpc", "-H", "te: trailers"]
                subprocess.run([*base, "-c", "1", "-n", "500", url], check=True,
                               capture_output=True, timeout=120)
                log = tmp / "stack.log"
                log.unlink(missing_ok=True)
                subprocess.run([*base, "-c", "1", "-n", str(n), "--log-file", str(log), url],
                               check=True, capture_output=True, timeout=300)
                lat = [float(c.split("\t")[2]) for c in log.read_text().splitlines()
                       if c.split("\t")[1] == "200"]
                res.setdefault(f"grpc_stack_{kind}_p50_us", []).append(_percentile(lat, 0.5))
                out = subprocess.run([*base, "-c", "32", "-n", str(n), url], check=True,
                                     capture_output=True, text=True, timeout=300).stdout
                rate = float(out.split(" req/s")[0].rsplit(" ", 1)[1])
                res.setdefault(f"grpc_stack_{kind}_per_s_c32", []).append(rate)
            finally:
                proc.terminate()
                proc.wait(10)
    return {k: round(statistics.median(v), 1) for k, v in res.items()}


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


class _Serve:
    """``inferencecache serve`` in a child process; stderr drained by a thread."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCECACHE_")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferencecache.cli",
                "serve",
                "--grpc-address",
                "127.0.0.1:0",
                "--http-address",
                "127.0.0.1:0",
                "--max-holds",
                "0",
                "--sweep-interval",
                "1h",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        self.grpc_port = self._wait_serving()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def _wait_serving(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError("serve exited during start-up")
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("msg") == "serving":
                return int(str(rec["grpc_address"]).rsplit(":", 1)[1])
        raise RuntimeError("serve did not start in time")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _load(stub: Any, holds: int, target_hashes: list[bytes]) -> None:
    """``holds`` holds in 512-block chain entries; replica 0 holds the lookup target."""

    def updates() -> Any:
        target = pb.PrefixEntry(
            block_hashes=target_hashes,
            block_token_counts=[BLOCK] * len(target_hashes),
            tier=pb.CACHE_TIER_T1,
        )
        yield pb.CacheStateUpdate(
            replica_id="r0",
            model_id=MODEL,
            tenant_id=TENANT,
            hash_scheme=SCHEME,
            prefixes=[target],
        )
        remaining = holds - len(target_hashes)
        next_hash = 1 << 40
        entry_no = 0
        while remaining > 0:
            by_replica: dict[int, list[pb.PrefixEntry]] = {}
            for _ in range(ENTRIES_PER_UPDATE):
                if remaining <= 0:
                    break
                n = min(ENTRY_BLOCKS, remaining)
                hashes = [(next_hash + i).to_bytes(8, "big") for i in range(n)]
                next_hash += n
                remaining -= n
                entry = pb.PrefixEntry(
                    block_hashes=hashes, block_token_counts=[BLOCK] * n, tier=pb.CACHE_TIER_T1
                )
                by_replica.setdefault(entry_no % REPLICAS, []).append(entry)
                entry_no += 1
            for replica, entries in by_replica.items():
                yield pb.CacheStateUpdate(
                    replica_id=f"r{replica}",
                    model_id=MODEL,
                    tenant_id=TENANT,
                    hash_scheme=SCHEME,
                    prefixes=entries,
                )

    ack = stub.ReportCacheState(updates(), timeout=600)
    assert ack.accepted


def _frame(msg: bytes) -> bytes:
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


def _h2load(port: int, method: str, body: Path, n: int, conc: int, tmp: Path) -> list[float]:
    log = tmp / f"h2load-{method}-{conc}.log"
    url = f"http://127.0.0.1:{port}/{SERVICE}/{method}"
    base = [
        "h2load",
        "-t",
        "1",
        "-c",
        "1",
        "-m",
        str(conc),
        "-d",
        str(body),
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
    ]
    subprocess.run(
        [*base, "-n", str(min(n, 1000)), url], check=True, capture_output=True, timeout=600
    )  # warm-up
    subprocess.run(
        [*base, "-n", str(n), "--log-file", str(log), url],
        check=True,
        capture_output=True,
        timeout=600,
    )
    out = []
    for line in log.read_text().splitlines():
        cols = line.split("\t")
        if len(cols) >= 3 and cols[1] == "200":
            out.append(float(cols[2]))
    if len(out) < n * 0.99:
        raise RuntimeError(f"h2load: only {len(out)} of {n} requests succeeded")
    return out


def _python_client(port: int, method: str, body: Path, n: int, conc: int) -> list[float]:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            PY_CLIENT,
            f"127.0.0.1:{port}",
            f"/{SERVICE}/{method}",
            str(body),
            str(n),
            str(conc),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )
    values: list[float] = json.loads(proc.stdout)
    return values


def _median_call_us(fn: Any, reps: int) -> float:
    """Median µs per call over batches of 50 calls (in-process micro-benchmark)."""
    for _ in range(50):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(50):
            fn()
        samples.append((time.perf_counter_ns() - t0) / 50_000)
    return round(statistics.median(samples), 1)


def parser_figures(bodies: dict[str, bytes], quick: bool) -> dict[str, float]:
    """The server's wire parser against protobuf (parse + materialise what the index needs)."""
    from inferencecache.server import lookup_wire

    reps = 20 if quick else 100
    out: dict[str, float] = {}
    for shape in ("chain", "tokens"):
        body = bodies[shape]

        def proto(body: bytes = body) -> object:
            return lookup_wire.from_message(pb.LookupRouteRequest.FromString(body))

        def fast(body: bytes = body) -> object:
            return lookup_wire.parse_lookup_request(body)

        out[f"grpc_lookup_parse_{shape}_us"] = _median_call_us(fast, reps)
        out[f"grpc_lookup_parse_{shape}_protobuf_us"] = _median_call_us(proto, reps)
    return out


def run(quick: bool, client: str | None = None) -> dict[str, Any]:
    holds = 50_000 if quick else 1_000_000
    n = 2_000 if quick else 20_000
    client = client or ("h2load" if shutil.which("h2load") else "python")
    rnd = random.Random(1337)
    toks = [rnd.randrange(VOCAB) for _ in range(TOKENS)]
    hashes, counts = fingerprint.chain(toks, BLOCK)
    assert len(hashes) == TOKENS // BLOCK
    bodies = {
        "chain": pb.LookupRouteRequest(
            model_id=MODEL,
            tenant_id=TENANT,
            hash_scheme=SCHEME,
            block_hashes=hashes,
            block_token_counts=counts,
        ).SerializeToString(),
        "tokens": pb.LookupRouteRequest(
            model_id=MODEL, tenant_id=TENANT, hash_scheme=SCHEME, token_ids=toks
        ).SerializeToString(),
        "trivial": pb.RenderTemplateRequest().SerializeToString(),
    }
    # the same trivial RPC with a request as large as the chain's: what the bytes cost the transport
    bodies["sized"] = pb.RenderTemplateRequest(
        template_ref="x" * (len(bodies["chain"]) - 3)).SerializeToString()
    methods = {"chain": "LookupRoute", "tokens": "LookupRoute", "trivial": "RenderTemplate",
               "sized": "RenderTemplate"}
    out: dict[str, Any] = {
        **parser_figures(bodies, quick),
        "grpc_lookup_holds": holds,
        "grpc_lookup_client": client,
        "grpc_lookup_requests_per_case": n,
    }
    server = _Serve()
    try:
        with tempfile.TemporaryDirectory() as tmpdir:
            tmp = Path(tmpdir)
            with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
                from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

                stub = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
                t0 = time.perf_counter()
                _load(stub, holds, hashes)
                out["grpc_lookup_load_s"] = round(time.perf_counter() - t0, 2)
                for shape in ("chain", "tokens"):
                    resp = stub.LookupRoute(
                        pb.LookupRouteRequest.FromString(bodies[shape]), timeout=30
                    )
                    assert resp.reason_code == "PREFIX_MATCH", (shape, resp.reason_code)
                    assert resp.replica_scores[0].matched_tokens == TOKENS
            out["grpc_lookup_server_rss_mb"] = round(server.rss_mb(), 1)
            paths = {}
            for shape, body in bodies.items():
                paths[shape] = tmp / f"{shape}.bin"
                paths[shape].write_bytes(_frame(body) if client == "h2load" else body)
            # concurrency 1: the shapes in interleaved rounds, so drift hits each alike
            lat1: dict[str, list[float]] = {shape: [] for shape in bodies}
            for _round in range(ROUNDS):
                for shape in bodies:
                    if client == "h2load":
                        lat = _h2load(server.grpc_port, methods[shape], paths[shape],
                                      n // ROUNDS, 1, tmp)
                    else:
                        lat = _python_client(server.grpc_port, methods[shape], paths[shape],
                                             n // ROUNDS, 1)
                    lat1[shape] += lat
            for shape in bodies:
                name = {"trivial": "baseline", "sized": "sized_floor"}.get(shape, shape)
                for conc in ((1,) if shape == "sized" else (1, 8)):
                    if conc == 1:
                        lat = lat1[shape]
                    elif client == "h2load":
                        lat = _h2load(server.grpc_port, methods[shape], paths[shape], n, conc, tmp)
                    else:
                        lat = _python_client(server.grpc_port, methods[shape], paths[shape], n,
                                             conc)
                    suffix = "" if conc == 1 else "_c8"
                    out[f"grpc_lookup_{name}_p50_us{suffix}"] = round(_percentile(lat, 0.5), 1)
                    out[f"grpc_lookup_{name}_p99_us{suffix}"] = round(_percentile(lat, 0.99), 1)
                    out[f"grpc_lookup_{name}_mean_us{suffix}"] = round(statistics.fmean(lat), 1)
    finally:
        server.stop()
    for shape in ("chain", "tokens"):
        out[f"grpc_lookup_{shape}_over_baseline_p50"] = round(
            out[f"grpc_lookup_{shape}_p50_us"] / out["grpc_lookup_baseline_p50_us"], 2
        )
    out["grpc_floor_p50_us"] = out["grpc_lookup_baseline_p50_us"]
    out["grpc_lookup_chain_over_floor"] = out["grpc_lookup_chain_over_baseline_p50"]
    out["grpc_lookup_chain_over_sized_floor"] = round(
        out["grpc_lookup_chain_p50_us"] / out["grpc_lookup_sized_floor_p50_us"], 2)
    if client == "h2load":
        with tempfile.TemporaryDirectory() as tmpdir:
            out.update(stack_figures(quick, Path(tmpdir)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="50k holds, 2k requests per case")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--client", choices=("h2load", "python"), default=None)
    args = ap.parse_args()
    result = run(args.quick, args.client)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:45s} {value}")


if __name__ == "__main__":
    main()
