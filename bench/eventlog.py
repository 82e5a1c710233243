"""The shared event log (docs/event-log.md): ingest through the log, lag, start-up, workers.

    python bench/eventlog.py [--quick] [--json]

`run(quick)` returns the figures (keys below) for bench/run.py's ``log`` section. A private
redis-server (127.0.0.1, free port, temp dir, append-only) per measurement; every process is
stopped by its own PID. Each figure is a ratio against a baseline measured in the same run.

- ``log_ingest_direct_blocks_per_s``: fake engine → subscriber → ``serve`` without the log
  (bench/e2e_ingest.py's pipeline); ``log_ingest_1_blocks_per_s``: the same into ``serve
  --event-log`` (append, then its follower applies); ``log_ingest_2_blocks_per_s``: until a
  second replica (another ``serve --event-log`` with no subscriber) has applied every block
  too; ``log_ingest_ratio_1`` / ``_2`` against direct (target ≥ 0.5).
- ``log_lag_p50_ms`` / ``_p99_ms``: append → visible on a replica, updates of 1,024 blocks at
  half the 1-replica rate (in process: an ``Appender`` and a read-only ``Replica``; the time
  from ``submit`` until the replica has applied the entry).
- ``log_startup_snapshot_s`` / ``log_startup_replay_s`` (and ``_ratio``): a replica of a log
  holding 1M holds (10M in full mode) ready from its snapshot vs by replaying the log.
- ``log_lookup_rps_workers_1`` / ``_2`` (and ``log_lookup_workers_ratio``, target ≥ 1.4):
  LookupRoute requests/s from h2load with 32 concurrent callers (32 connections) against
  ``serve --event-log --workers N``, 64-block chains over 50k holds.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import log, percentile, print_figures, sigterm_as_exit
from bench.e2e_ingest import BLOCK, NEW_BLOCKS, REQUESTS_PER_STEP, _metric, _wall
from inferencecache.procs import Children, RedisServer

SERVICE = "inferencecache.v1alpha1.InferenceCache"


def _ingest(blocks: int, mode: str, tmp: Path) -> float | None:
    """Blocks/s end to end; ``mode``: direct, log1, log2."""
    steps = max(1, round(blocks / (REQUESTS_PER_STEP * (1 + NEW_BLOCKS) / 2)))
    rdir = tmp / f"redis-{mode}"
    rdir.mkdir()
    redis_srv = RedisServer(str(rdir)).start() if mode != "direct" else None
    try:
        with Children() as procs:
            log_args = ["--event-log", redis_srv.url] if redis_srv is not None else []
            servers = [procs.start("serve", "--grpc-address", "127.0.0.1:0", "--http-address",
                                   "127.0.0.1:0", "--block-size", str(BLOCK), *log_args,
                                   inherit=False)]
            if mode == "log2":
                servers.append(procs.start("serve", "--grpc-address", "127.0.0.1:0",
                                           "--http-address", "127.0.0.1:0", "--block-size",
                                           str(BLOCK), *log_args, inherit=False))
            recs = [s.wait_log("serving", timeout=60) for s in servers]
            urls = [f"http://{r['http_address']}/metrics" for r in recs]
            engine = procs.start(
                "fake-engine", "--mode", "random", "--seed", "1", "--steps", str(steps),
                "--interval", "0", "--requests-per-step", str(REQUESTS_PER_STEP), "--new-blocks",
                str(NEW_BLOCKS), "--prefix-blocks", "0", "--bind", "tcp://127.0.0.1:0",
                "--http-address", "", "--wait-for-subscriber", "--start-delay", "200ms",
                "--precompute", "--block-size", str(BLOCK), inherit=False)
            ready = engine.wait_log("fake engine ready", timeout=60)
            sub = procs.start("subscribe", "--replica-id", "bench", "--model-id", "m",
                              "--engine-endpoint", ready["endpoint"], "--server",
                              recs[0]["grpc_address"], "--metrics-address", "127.0.0.1:0",
                              "--engine-metrics-url", "", "--block-size", str(BLOCK),
                              inherit=False)
            sub.wait_log("subscribed to engine KV events", timeout=60)
            t_start = _wall(engine.wait_log("workload publishing", timeout=120))
            done = engine.wait_log("workload done", timeout=600)
            stored = int(done["blocks_stored"])
            last, last_change = -1.0, time.monotonic()
            while True:
                counts = [_metric(u, "inferencecache_index_entries") for u in urls]
                t_end = time.time()
                if min(counts) >= stored:
                    break
                if sum(counts) != last:
                    last, last_change = sum(counts), time.monotonic()
                elif time.monotonic() - last_change > 15:
                    log(f"  {mode}: stalled at {counts} of {stored}")
                    return None
                time.sleep(0.05)
            return stored / (t_end - t_start)
    finally:
        if redis_srv is not None:
            redis_srv.stop()


def _update(replica: str, first: int, n: int) -> bytes:
    from inferencecache.v1alpha1 import inferencecache_pb2 as pb

    return bytes(pb.CacheStateUpdate(
        replica_id=replica, model_id="m", tenant_id="t", hash_scheme="s",
        prefixes=[pb.PrefixEntry(prefix_hash=(first + i).to_bytes(8, "big"), token_count=BLOCK)
                  for i in range(n)]).SerializeToString())


def _lag(rate_blocks: float, seconds: float, tmp: Path) -> dict[str, Any]:
    from inferencecache.eventlog import EventLogConfig, EventLogMetrics, RedisLog, Replica, codec
    from inferencecache.eventlog.appender import Appender

    per = 1024
    interval = per / rate_blocks
    rdir = tmp / "redis-lag"
    rdir.mkdir()
    with RedisServer(str(rdir)) as srv:
        node = Appender(RedisLog(srv.url), EventLogMetrics())  # a writer only: no index here
        node.start()
        payloads = [_update(f"r{i % 8}", i * per, per) for i in range(int(seconds / interval) + 1)]
        lags: list[float] = []
        with Replica(EventLogConfig(srv.url)) as rep:
            rep.wait_ready(10)
            follower = rep.node.follower
            nxt = time.perf_counter()
            for seq, payload in enumerate(payloads, start=1):
                time.sleep(max(0.0, nxt - time.perf_counter()))
                nxt += interval
                t0 = time.perf_counter()
                node.submit(codec.KIND_UPDATE, payload).result(10)
                if not follower.wait_for(seq, 10):
                    raise RuntimeError("the replica never applied an entry")
                lags.append((time.perf_counter() - t0) * 1000)
        node.close()
    return {"log_lag_p50_ms": round(percentile(lags, 0.5), 2),
            "log_lag_p99_ms": round(percentile(lags, 0.99), 2),
            "log_lag_samples": len(lags), "log_lag_rate_blocks_per_s": round(rate_blocks)}


def _startup(holds: int, tmp: Path) -> dict[str, Any]:
    import redis

    from inferencecache.eventlog import EventLogConfig, EventLogMetrics, LogNode, Replica, codec
    from inferencecache.index import Index, IndexSettings

    per = 4096
    settings = IndexSettings(max_holds=0)
    rdir = tmp / "redis-startup"
    rdir.mkdir()
    snaps = tmp / "snaps"
    with RedisServer(str(rdir)) as srv:
        node = LogNode(Index(settings), EventLogConfig(srv.url), EventLogMetrics())
        node.start()
        futs = [node.submit(codec.KIND_UPDATE, _update(f"r{i % 8}", i * per, per))
                for i in range(holds // per)]
        for f in futs:
            f.result(60)
        head = int(redis.Redis.from_url(srv.url).get(node.log.keys.seq) or 0)
        node.stop()
        cfg = EventLogConfig(srv.url, snapshot_dir=str(snaps))
        t0 = time.perf_counter()
        with Replica(cfg, settings=settings) as rep:
            rep.node.follower.wait_for(head, 600)  # every entry, not only "ready"
            replay_s = time.perf_counter() - t0
            n = rep.index.counts()["holds"]
            rep.node.follower.snapshot_now()
        t0 = time.perf_counter()
        with Replica(cfg, settings=settings) as rep2:
            rep2.node.follower.wait_for(head, 600)
            snap_s = time.perf_counter() - t0
            assert rep2.index.counts()["holds"] == n
    size = sum(p.stat().st_size for p in snaps.iterdir())
    return {"log_startup_holds": n, "log_startup_replay_s": round(replay_s, 2),
            "log_startup_snapshot_s": round(snap_s, 2),
            "log_startup_ratio": round(replay_s / snap_s, 2) if snap_s else None,
            "log_snapshot_bytes_per_hold": round(size / max(1, n), 1)}


def _lookup_rps(workers: int, requests: int, tmp: Path) -> float:
    import grpc

    from inferencecache.v1alpha1 import inferencecache_pb2 as pb
    from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

    rdir = tmp / f"redis-w{workers}"
    rdir.mkdir()
    with RedisServer(str(rdir)) as srv, Children() as procs:
        proc = procs.start("serve", "--grpc-address", "127.0.0.1:0", "--http-address",
                           "127.0.0.1:0", "--event-log", srv.url, "--workers", str(workers),
                           inherit=False)
        rec = proc.wait_log("serving with workers" if workers > 1 else "serving", timeout=120)
        port = int(rec["grpc_port"]) if workers > 1 else int(rec["grpc_address"].rsplit(":")[1])
        chain = [(i + 1).to_bytes(8, "big") for i in range(64)]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub: Any = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
            for r in range(8):
                stub.ReportCacheState(iter([pb.CacheStateUpdate(
                    replica_id=f"r{r}", model_id="m", tenant_id="t", hash_scheme="s",
                    prefixes=[pb.PrefixEntry(prefix_hash=(10_000 * (r + 1) + i).to_bytes(8, "big"),
                                             token_count=BLOCK) for i in range(6000)]
                    + [pb.PrefixEntry(block_hashes=chain[: 64 - 4 * r],
                                      block_token_counts=[BLOCK] * (64 - 4 * r))])]), timeout=30)
        time.sleep(2.0)  # every worker applies the log
        body = tmp / f"lookup-{workers}.bin"
        msg = pb.LookupRouteRequest(tenant_id="t", model_id="m", hash_scheme="s",
                                    block_hashes=chain,
                                    block_token_counts=[BLOCK] * 64).SerializeToString()
        body.write_bytes(b"\x00" + len(msg).to_bytes(4, "big") + msg)
        url = f"http://127.0.0.1:{port}/{SERVICE}/LookupRoute"
        base = ["h2load", "-t", "1", "-c", "32", "-m", "1", "-d", str(body), "-H",
                "content-type: application/grpc", "-H", "te: trailers"]
        subprocess.run([*base, "-n", "2000", url], check=True, capture_output=True, timeout=300)
        out = subprocess.run([*base, "-n", str(requests), url], check=True, capture_output=True,
                             text=True, timeout=600).stdout
        m = re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", out)
        ok = re.search(r"(\d+) succeeded", out)
        if m is None or ok is None or int(ok.group(1)) < requests * 0.99:
            raise RuntimeError(f"h2load did not finish cleanly:\n{out[-2000:]}")
        return float(m.group(1))


def run(quick: bool) -> dict[str, Any]:
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-log-") as d:
        tmp = Path(d)
        blocks = 150_000 if quick else 600_000
        log("log: ingest direct vs through the log into 1 and 2 replicas")
        direct = _ingest(blocks, "direct", tmp)
        one = _ingest(blocks, "log1", tmp)
        two = _ingest(blocks, "log2", tmp)
        res["log_ingest_direct_blocks_per_s"] = round(direct) if direct else None
        res["log_ingest_1_blocks_per_s"] = round(one) if one else None
        res["log_ingest_2_blocks_per_s"] = round(two) if two else None
        if direct and one:
            res["log_ingest_ratio_1"] = round(one / direct, 2)
        if direct and two:
            res["log_ingest_ratio_2"] = round(two / direct, 2)
        log("log: append -> visible lag at half the 1-replica rate")
        res.update(_lag((one or 50_000) / 2, 5.0 if quick else 20.0, tmp))
        log("log: replica start-up, snapshot vs replay")
        res.update(_startup(1_000_000 if quick else 10_000_000, tmp))
        log("log: LookupRoute throughput, 32 callers, --workers 1 vs 2")
        n = 20_000 if quick else 100_000
        w1 = _lookup_rps(1, n, tmp)
        w2 = _lookup_rps(2, n, tmp)
        res["log_lookup_rps_workers_1"] = round(w1)
        res["log_lookup_rps_workers_2"] = round(w2)
        res["log_lookup_workers_ratio"] = round(w2 / w1, 2)
        res["log_loadavg"] = list(os.getloadavg())
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    with sigterm_as_exit():
        print_figures(run(args.quick), as_json=args.json)


if __name__ == "__main__":
    main()

