"""End-to-end ingest benchmark: fake engine → ZeroMQ → subscriber → gRPC → server index.

    python bench/e2e_ingest.py [--quick] [--json]

`run(quick)` returns the figures as a dict (keys below) for bench/run.py.

Processes (all on 127.0.0.1, ports chosen at run time, each stopped by its own PID):
``inferencecache serve``, ``inferencecache subscribe`` and ``inferencecache fake-engine
--mode random`` (vLLM 0.33 map events, 16-token blocks, 16 requests per batch, each request
1-8 fresh blocks, no shared prefixes, no evictions: every block stored is a new index key).

Figures:
- ``e2e_ingest_blocks_per_s``: blocks stored by the engine / seconds from the engine's first
  batch until the server's ``inferencecache_index_entries`` gauge counts them all (polled every
  50 ms); ``e2e_blocks``, ``e2e_seconds``, ``e2e_complete`` (every block arrived);
- ``engine_publish_blocks_per_s``: how fast the engine produced them (it runs unthrottled and
  finishes first; the PUB/SUB high-water marks hold the backlog, so nothing is dropped:
  ``e2e_missed_batches`` reports the subscriber's missed-batch counter);
- ``subscriber_decode_map_blocks_per_s``: the subscriber alone, in process: decode + block →
  fingerprint mapping of pre-encoded batches (no sockets, no RPC), per CPU second (process
  time, so other load on the machine does not count);
  ``subscriber_decode_map_build_blocks_per_s`` adds encoding the ``CacheStateUpdate`` wire bytes
  (``messages.UpdateEncoder``, what the subscriber sends);
- ``e2e_evict_blocks_per_s``: the same pipeline when the engine cache is full, so each stored
  block evicts one (batched ``PREFIX_EVICTED`` events: ``subscribe --batch-evictions``, the
  default): stored blocks per second with as many evictions delivered;
  ``e2e_evict_unbatched_blocks_per_s`` (full runs only): the same with
  ``--batch-evictions=false``, one unary ``PublishEvent`` per evicted block.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.request
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import log, sigterm_as_exit
from inferencecache.procs import Children

BLOCK = 16
REQUESTS_PER_STEP = 16
NEW_BLOCKS = 8  # 1..8 per request, 4.5 on average


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _e2e(blocks: int, gpu_blocks: int = 0, sub_args: tuple[str, ...] = ()) -> dict[str, Any]:
    steps = max(1, round(blocks / (REQUESTS_PER_STEP * (1 + NEW_BLOCKS) / 2)))
    with Children() as procs:
        server = procs.start("serve", "--grpc-address", "127.0.0.1:0", "--http-address",
                             "127.0.0.1:0", "--block-size", str(BLOCK), inherit=False)
        srv = server.wait_log("serving", timeout=60)
        server_metrics = f"http://{srv['http_address']}/metrics"
        engine = procs.start(
            "fake-engine", "--mode", "random", "--seed", "1", "--steps", str(steps),
            "--interval", "0", "--requests-per-step", str(REQUESTS_PER_STEP), "--new-blocks",
            str(NEW_BLOCKS), "--prefix-blocks", "0", "--gpu-blocks", str(gpu_blocks),
            "--bind", "tcp://127.0.0.1:0", "--http-address", "", "--wait-for-subscriber",
            "--start-delay", "200ms", "--precompute", "--block-size", str(BLOCK),
            inherit=False,
        )
        ready = engine.wait_log("fake engine ready", timeout=60)
        sub = procs.start("subscribe", "--replica-id", "bench", "--model-id", "m",
                          "--engine-endpoint", ready["endpoint"], "--server", srv["grpc_address"],
                          "--metrics-address", "127.0.0.1:0", "--engine-metrics-url", "",
                          "--block-size", str(BLOCK), *sub_args, inherit=False)
        sub_metrics = f"http://{sub.wait_log('metrics listening', timeout=60)['address']}/metrics"
        sub.wait_log("subscribed to engine KV events", timeout=60)
        t_start = _wall(engine.wait_log("workload publishing", timeout=120))
        done = engine.wait_log("workload done", timeout=600)
        stored = int(done["blocks_stored"])
        target = stored - (gpu_blocks if gpu_blocks else 0)
        last, last_change = -1.0, time.monotonic()
        complete = False
        now_entries = delivered = 0.0
        t_end = time.time()
        while True:
            now_entries = _metric(server_metrics, "inferencecache_index_entries")
            if gpu_blocks:
                delivered = _metric(sub_metrics, "inferencecache_subscriber_evictions_total")
                progress = delivered
                complete = delivered >= target and now_entries >= gpu_blocks
            else:
                progress = now_entries
                complete = now_entries >= stored
            t_end = time.time()
            if complete:
                break
            if progress != last:
                last, last_change = progress, time.monotonic()
            elif time.monotonic() - last_change > 15:
                break  # stalled: report what arrived
            time.sleep(0.05)
        seconds = t_end - t_start
        out = {
            "blocks": stored,
            "seconds": round(seconds, 3),
            "blocks_per_s": round(stored / seconds) if seconds > 0 else None,
            "complete": complete,
            "engine_publish_blocks_per_s": round(stored / done["elapsed_s"])
            if done["elapsed_s"] else None,
            "missed_batches": _metric(
                sub_metrics, "inferencecache_subscriber_missed_batches_total"),
            "adds_not_sent": _metric(sub_metrics, "inferencecache_subscriber_adds_not_sent_total"),
            "server_index_entries": now_entries,
        }
        if gpu_blocks:
            out["evictions_delivered"] = delivered
        for name, child in (("server", server), ("subscriber", sub), ("engine", engine)):
            cpu = _cpu_seconds(child.pid)
            if cpu is not None and stored:
                out[f"cpu_us_per_block_{name}"] = round(cpu * 1e6 / stored, 2)
        return out


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), ``None`` elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _wall(rec: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(str(rec["time"]).replace("Z", "+00:00")).timestamp()


def _in_process(blocks: int) -> dict[str, Any]:
    """Decode + map (and protobuf build) of pre-encoded 0.33 map batches, no I/O."""
    from inferencecache.kvevents.decode import BatchDecoder
    from inferencecache.kvevents.encode import WireStored, encode_batch
    from inferencecache.subscriber.lora import LoraResolver
    from inferencecache.subscriber.mapping import BlockMapper
    from inferencecache.subscriber.messages import Entry, Identity, UpdateEncoder
    from inferencecache.subscriber.metrics import SubscriberMetrics

    rng = random.Random(1)
    payloads: list[bytes] = []
    n = 0
    hash_counter = 1
    while n < blocks:
        events = []
        for _ in range(REQUESTS_PER_STEP):
            k = rng.randint(1, NEW_BLOCKS)
            hashes: list[int | bytes] = list(range(hash_counter, hash_counter + k))
            hash_counter += k
            tokens = [rng.randrange(128_000) for _ in range(k * BLOCK)]
            events.append(WireStored(hashes, None, tokens, BLOCK, medium="GPU",
                                     extra_keys=[None] * k, group_idx=0,
                                     kv_cache_spec_kind="full_attention"))
            n += k
        payloads.append(encode_batch(time.time(), events, "vllm-0.33"))

    class Sink:
        def __init__(self) -> None:
            self.entries: list[Entry] = []

        def add_many(self, entries: list[Entry], ts_us: int) -> None:
            self.entries.extend(entries)

        def flush(self) -> None: ...
        def report(self, entries: list[Entry], ts_us: int) -> None: ...
        def evict(self, prefix: bytes, adapter: str, ts_us: int) -> None: ...
        def clear(self, ts_us: int) -> None: ...
        def refresh(self, entries: list[Entry]) -> None: ...

    def once(build: bool) -> float:
        sink = Sink()
        mapper = BlockMapper(block_size=BLOCK, resolver=LoraResolver({}), outbox=sink,
                             metrics=SubscriberMetrics())
        decoder = BatchDecoder()
        encoder = UpdateEncoder(Identity("r", "m", "default", "vllm"))
        t0 = time.process_time()  # CPU time: robust on a busy machine, one thread
        for p in payloads:
            mapper.apply(decoder.decode(p))
            if build and len(sink.entries) >= 4096:
                encoder.encode(sink.entries, 1)
                sink.entries = []
        if build and sink.entries:
            encoder.encode(sink.entries, 1)
        return time.process_time() - t0

    best = min(once(False) for _ in range(3))
    best_build = min(once(True) for _ in range(3))
    return {
        "subscriber_decode_map_blocks_per_s": round(n / best),
        "subscriber_decode_map_build_blocks_per_s": round(n / best_build),
        "subscriber_in_process_blocks": n,
    }


def run(quick: bool) -> dict[str, Any]:
    res: dict[str, Any] = {}
    log("subscriber alone (decode + map), in process")
    res.update(_in_process(100_000 if quick else 400_000))
    log("end to end: fake engine -> subscriber -> server")
    e2e = _e2e(200_000 if quick else 1_000_000)
    res["e2e_ingest_blocks_per_s"] = e2e["blocks_per_s"]
    res.update({f"e2e_{k}": v for k, v in e2e.items() if k != "blocks_per_s"})
    log("end to end with a full engine cache (one eviction per stored block)")
    # ≤ 60k: the engine publishes its whole backlog at once, and more evictions than the
    # subscriber's send queue holds (65,536) would turn the tail into a resync (by design).
    ev = _e2e(60_000, gpu_blocks=2_000)
    res["e2e_evict_blocks_per_s"] = ev["blocks_per_s"]
    res.update({f"e2e_evict_{k}": v for k, v in ev.items() if k != "blocks_per_s"})
    if not quick:
        log("the same, one PublishEvent per evicted block (--batch-evictions=false)")
        un = _e2e(30_000, gpu_blocks=2_000, sub_args=("--batch-evictions=false",))
        res["e2e_evict_unbatched_blocks_per_s"] = un["blocks_per_s"]
        res.update({f"e2e_evict_unbatched_{k}": v for k, v in un.items()
                    if k != "blocks_per_s"})
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer blocks")
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
