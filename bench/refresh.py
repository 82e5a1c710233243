"""What keeping live holds alive costs (issue 11): the subscriber's refresher and the server.

    python bench/refresh.py [--quick] [--json]

`run(quick)` returns the figures as a dict (keys below) for bench/run.py.

1. **One engine, real processes** (all on 127.0.0.1, stopped by PID): ``serve``, a fake engine
   (``--mode random``) that stores ``BLOCKS`` blocks and then stays idle, and two subscribers on
   the same event stream: one refreshing with a cycle of ``BLOCKS / MIN_BATCH`` seconds (one
   slice of ``MIN_BATCH`` blocks per second: the same update size as the default 10 min cycle,
   only more of them), one with ``--refresh-interval 0``. Over ``window`` seconds: the CPU of
   both subscribers and of the server (``/proc``), and the entries re-reported; then the
   refreshing subscriber stops and the server's CPU is measured again (its baseline).
   ``refresh_sub_cpu_us_per_entry`` = (refreshing − idle subscriber CPU) / entries;
   ``refresh_server_cpu_us_per_entry`` = (server CPU while refreshed − baseline) / entries.
   Scaled to the default cycle (``--refresh-interval 10m``): ``refresh_entries_per_s_per_engine``
   = BLOCKS / 600, ``refresh_sub_cpu_pct_per_engine`` and ``refresh_server_cpu_pct_100_engines``
   (% of one core).
2. **The server at 100 engines' scale, directly** (full runs): ``serve`` holding 100 replicas ×
   BLOCKS distinct blocks (2M holds), and a client sending exactly the default refresh traffic of
   100 engines (updates of ``MIN_BATCH`` entries, one ``ReportCacheState`` stream each, as the
   forwarder sends them, ~3,300 entries/s). ``refresh_server_cpu_pct_100_engines_direct`` =
   (server CPU with that traffic − without it) / wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import log, sigterm_as_exit
from bench.e2e_ingest import _cpu_seconds
from inferencecache.procs import Children
from inferencecache.subscriber.refresh import DEFAULT_INTERVAL, MIN_BATCH

BLOCK = 16
BLOCKS = 20_000
ENGINES = 100


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _cpu(pid: int) -> float:
    v = _cpu_seconds(pid)
    if v is None:
        raise RuntimeError("needs Linux /proc for process CPU times")
    return v


def _one_engine(window: float) -> dict[str, Any]:
    interval = BLOCKS / MIN_BATCH  # one MIN_BATCH slice per second
    steps = BLOCKS // 40  # 16 requests of 1-4 (2.5) fresh blocks per batch
    with Children() as procs:
        server = procs.start("serve", "--grpc-address", "127.0.0.1:0", "--http-address",
                             "127.0.0.1:0", "--block-size", str(BLOCK), inherit=False)
        srv = server.wait_log("serving", timeout=60)
        engine = procs.start(
            "fake-engine", "--mode", "random", "--seed", "3", "--steps", str(steps),
            "--interval", "0", "--requests-per-step", "16", "--new-blocks", "4",
            "--prefix-blocks", "0", "--bind", "tcp://127.0.0.1:0", "--http-address", "",
            "--wait-for-subscriber", "--start-delay", "1s", "--block-size", str(BLOCK),
            inherit=False)
        ready = engine.wait_log("fake engine ready", timeout=60)
        subs = {}
        for name, every in (("refreshing", f"{interval:g}s"), ("idle", "0")):
            p = procs.start("subscribe", "--replica-id", name, "--model-id", "m",
                            "--engine-endpoint", ready["endpoint"],
                            "--server", srv["grpc_address"], "--metrics-address", "127.0.0.1:0",
                            "--engine-metrics-url", "", "--engine-models-url", "",
                            "--block-size", str(BLOCK), "--refresh-interval", every,
                            inherit=False)
            url = f"http://{p.wait_log('metrics listening', timeout=60)['address']}/metrics"
            p.wait_log("subscribed to engine KV events", timeout=60)
            subs[name] = (p, url)
        stored = int(engine.wait_log("workload done", timeout=300)["blocks_stored"])
        deadline = time.monotonic() + 120
        for _, url in subs.values():
            while _metric(url, "inferencecache_subscriber_tracked_blocks") < stored:
                if time.monotonic() > deadline:
                    raise RuntimeError("the subscribers never tracked every block")
                time.sleep(0.2)
        ref, ref_url = subs["refreshing"]
        idle, _ = subs["idle"]
        # measure inside a cycle whose snapshot holds every block (the one after the first
        # blocks arrived may have started with only some of them)
        while _metric(ref_url, "inferencecache_subscriber_refresh_entries_total") < stored:
            if time.monotonic() > deadline + 3 * interval:
                raise RuntimeError("the refreshing subscriber never completed a cycle")
            time.sleep(0.5)
        e0 = _metric(ref_url, "inferencecache_subscriber_refresh_entries_total")
        c0 = (_cpu(ref.pid), _cpu(idle.pid), _cpu(server.pid))
        t0 = time.monotonic()
        time.sleep(window)
        c1 = (_cpu(ref.pid), _cpu(idle.pid), _cpu(server.pid))
        wall = time.monotonic() - t0
        entries = _metric(ref_url, "inferencecache_subscriber_refresh_entries_total") - e0
        procs.stop(ref)
        time.sleep(1.0)
        s0, b0 = _cpu(server.pid), time.monotonic()
        time.sleep(window)
        base = (_cpu(server.pid) - s0) / (time.monotonic() - b0)
    if entries <= 0:
        raise RuntimeError("the refreshing subscriber re-reported nothing")
    sub_extra = (c1[0] - c0[0]) - (c1[1] - c0[1])
    server_extra = (c1[2] - c0[2]) - base * wall
    per_s = stored / DEFAULT_INTERVAL
    sub_us = max(0.0, sub_extra) * 1e6 / entries
    srv_us = max(0.0, server_extra) * 1e6 / entries
    return {
        "refresh_blocks": stored,
        "refresh_bench_entries_per_s": round(entries / wall, 1),
        "refresh_sub_cpu_us_per_entry": round(sub_us, 2),
        "refresh_server_cpu_us_per_entry": round(srv_us, 2),
        "refresh_entries_per_s_per_engine": round(per_s, 1),
        "refresh_sub_cpu_pct_per_engine": round(per_s * sub_us / 1e4, 4),
        "refresh_server_cpu_pct_100_engines": round(ENGINES * per_s * srv_us / 1e4, 3),
    }


async def _drive(address: str, window: float, prefill: bool) -> tuple[int, float]:
    """Fill the server with ENGINES x BLOCKS holds, or send the default refresh traffic of
    ENGINES engines for ``window`` seconds; returns (entries sent, seconds)."""
    from inferencecache.subscriber.client import CacheClient
    from inferencecache.subscriber.messages import Identity, UpdateEncoder

    client = CacheClient(address, deadline=30.0)
    encoders = [UpdateEncoder(Identity(f"engine-{i:03d}", "m", "default", "vllm"))
                for i in range(ENGINES)]

    def entries(engine: int, start: int, n: int) -> list[tuple[bytes, int, str, int]]:
        base = engine * BLOCKS
        return [((base + (start + j) % BLOCKS + 1).to_bytes(8, "big"),
                 16 * ((start + j) % 64 + 1), "", 1) for j in range(n)]

    sent = 0
    t0 = time.monotonic()
    try:
        if prefill:
            for e in range(ENGINES):
                ups = [encoders[e].encode(entries(e, s, 4096), 0) for s in range(0, BLOCKS, 4096)]
                await client.report_many(ups)
                sent += BLOCKS
            return sent, time.monotonic() - t0
        rate = ENGINES * BLOCKS / DEFAULT_INTERVAL  # entries per second, all engines
        gap = MIN_BATCH / rate
        cursor = [0] * ENGINES
        k = 0
        nxt = time.monotonic()
        pending: set[asyncio.Task[Any]] = set()
        while time.monotonic() - t0 < window:
            e = k % ENGINES
            upd = encoders[e].encode(entries(e, cursor[e], MIN_BATCH), 0)
            cursor[e] += MIN_BATCH
            task = asyncio.create_task(client.report(upd))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += MIN_BATCH
            k += 1
            nxt += gap
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        if pending:
            await asyncio.gather(*pending)
        return sent, time.monotonic() - t0
    finally:
        await client.close()


def _hundred_engines(window: float) -> dict[str, Any]:
    with Children() as procs:
        server = procs.start("serve", "--grpc-address", "127.0.0.1:0", "--http-address",
                             "127.0.0.1:0", "--block-size", str(BLOCK), "--max-holds", "0",
                             inherit=False)
        srv = server.wait_log("serving", timeout=60)
        address = srv["grpc_address"]
        log(f"filling the server with {ENGINES} x {BLOCKS} holds")
        asyncio.run(_drive(address, 0, prefill=True))
        time.sleep(2.0)
        s0, t0 = _cpu(server.pid), time.monotonic()
        time.sleep(window)
        base = (_cpu(server.pid) - s0) / (time.monotonic() - t0)
        log(f"the default refresh traffic of {ENGINES} engines for {window:g}s")
        s1 = _cpu(server.pid)
        sent, wall = asyncio.run(_drive(address, window, prefill=False))
        loaded = (_cpu(server.pid) - s1) / wall
        holds = _metric(f"http://{srv['http_address']}/metrics", "inferencecache_index_entries")
    return {
        "refresh_direct_holds": holds,
        "refresh_direct_entries_per_s": round(sent / wall, 1),
        "refresh_server_cpu_pct_100_engines_direct": round(max(0.0, loaded - base) * 100, 3),
        "refresh_direct_server_idle_cpu_pct": round(base * 100, 3),
    }


def run(quick: bool) -> dict[str, Any]:
    window = 15.0 if quick else 30.0
    log("one engine: refreshing vs idle subscriber, server CPU per entry")
    res = _one_engine(window)
    if not quick:
        res.update(_hundred_engines(window))
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="shorter windows, one engine only")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    with sigterm_as_exit():
        res = run(args.quick)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:48} {v}")


if __name__ == "__main__":
    main()
