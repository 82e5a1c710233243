"""Index benchmark: bytes per hold, store walk and Router.lookup latency, ingest rate.

    python bench/index.py [--quick] [--json]

Compares the compiled store (``nativestore``) with its pure-Python twin (``memstore``) in the
same run. `run(quick)` returns the figures as a dict (keys below) for bench/run.py.

Workload (deterministic; every random choice comes from ``random.Random`` seeded with SEED):
- one partition (tenant ``t``, model ``m``, hash scheme ``vllm``, no adapter), REPLICAS = 8;
- PROMPTS = 32 shared "system prompts" of PROMPT_BLOCKS = 64 blocks, drawn with a Pareto(1.2)
  head (a few prompts are on most chains);
- a chain is a system prompt + 448 blocks of its own = 512 blocks of 16 tokens; chain i's own
  block hashes are ``Random(SEED * 1_000_003 + i).randbytes(448 * 8)`` (so any chain can be
  rebuilt for lookups without keeping it in memory), the prompt's are random 8-byte values too;
- each chain is stored on 1 (60 %), 2 (30 %) or 3 (10 %) distinct random replicas, one
  ``upsert_many`` per (chain, replica) with cumulative token counts, timestamps increasing.
That gives ~1.5 holds per key, shared prefixes with 8 holders, and 512-block chains whose walk
keeps 1-3 runs alive to the end (and up to 8 over the first 64 blocks).

Figures (each size is built in a fresh child process so RSS deltas are clean):
- ``bytes_per_hold_{1m,10m}``: whole-process RSS delta of building the store / holds (compiled
  store); ``*_accounted``: the store's own ``memory_bytes()``; ``*_tracemalloc``: tracemalloc's
  traced delta (sees Python objects and, as the C store allocates with PyMem_Raw*, the store);
- ``store_walk_512_p50_us`` / ``_p99_us``: ``store.walk`` of a stored 512-block chain (packed
  keys, a different chain each call so the table is cold as under real traffic) at 1M holds;
  ``store_walk_512_miss_p50_us``: a chain whose first block is unknown;
- ``index_lookup_512_p50_us`` / ``_p99_us``: the full in-process ``Router.lookup`` of a
  512-block chain (packed hashes) at 1M holds, on the compiled store;
- ``ingest_holds_per_s``: hold upserts per second through ``store.upsert_many`` (keys as a list
  of bytes, as the index passes them) while building 1M holds;
- ``index_ingest_holds_per_s``: the same through ``Index.apply_update``, and
  ``index_ingest_at_cap_holds_per_s`` once ``max_holds`` (= 1M) is reached, so every update also
  evicts its overflow (50 updates of 512 blocks, 10 with --quick);
- ``cap_candidates_1k_ms``: the first ``cap_candidates(1000, lfu=True)`` (a full scan; the
  compiled store also fills its candidate cache), ``cap_candidates_1k_next_ms``: the next call
  after evicting those 1000 (served from the cache); ``sweep_all_ms``: a sweep that removes
  every hold, and ``rss_left_after_sweep_mb``: RSS still above the baseline after it (memory
  handed back by the shrinking table);
- every figure also for the pure-Python twin under ``pure.`` (at 1M holds; it is not built at
  10M), and ``ratio.*`` = how many times better the compiled store is (pure / compiled for
  bytes and µs, compiled / pure for rates).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any

SEED = 20240611
REPLICAS = 8
PROMPTS = 32
PROMPT_BLOCKS = 64
CHAIN_BLOCKS = 512
OWN_BLOCKS = CHAIN_BLOCKS - PROMPT_BLOCKS
BLOCK_TOKENS = 16
COPIES = ([1, 2, 3], [6, 3, 1])  # replicas per chain and their weights
TENANT, MODEL, SCHEME = "t", "m", "vllm"
COUNTS = [BLOCK_TOKENS] * CHAIN_BLOCKS
CUMULATIVE = list(accumulate(COUNTS))


# ---------------------------------------------------------------------------------------------
# Workload


class Workload:
    """The seeded chain generator described in the module doc."""

    def __init__(self) -> None:
        self.rng = random.Random(SEED)
        self.prompts = [self.rng.randbytes(PROMPT_BLOCKS * 8) for _ in range(PROMPTS)]

    def chain(self, i: int) -> bytes:
        """Packed 8-byte block hashes of chain i (prompt choice is a function of i too)."""
        r = random.Random(SEED * 1_000_003 + i)
        prompt = self.prompts[min(int(r.paretovariate(1.2)) - 1, PROMPTS - 1)]
        return prompt + r.randbytes(OWN_BLOCKS * 8)

    def placements(self, holds: int, start: int = 0) -> Iterator[tuple[int, bytes, list[int]]]:
        """(chain index, packed keys, replicas) from chain `start` until about `holds` more
        holds exist."""
        made = 0
        i = start
        while made < holds:
            copies = self.rng.choices(COPIES[0], COPIES[1])[0]
            replicas = self.rng.sample(range(REPLICAS), copies)
            yield i, self.chain(i), replicas
            made += OWN_BLOCKS * copies  # prompt blocks are mostly refreshes
            i += 1


def split(packed: bytes) -> list[bytes]:
    return [packed[j : j + 8] for j in range(0, len(packed), 8)]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def percentiles(samples_ns: list[int]) -> tuple[float, float]:
    s = sorted(samples_ns)
    return s[len(s) // 2] / 1000, s[min(len(s) - 1, int(len(s) * 0.99))] / 1000


def timed(fn: Callable[[int], object], calls: int) -> tuple[float, float]:
    """p50/p99 µs of fn(j) over `calls` calls (after a short warm-up)."""
    for j in range(min(200, calls)):
        fn(j)
    out = []
    clock = time.perf_counter_ns
    for j in range(calls):
        t0 = clock()
        fn(j)
        out.append(clock() - t0)
    return percentiles(out)


def store_factory(backend: str) -> Callable[[], Any]:
    if backend == "native":
        from inferencecache.index.nativestore import NativeStore

        return NativeStore
    from inferencecache.index.memstore import MemStore

    return MemStore


# ---------------------------------------------------------------------------------------------
# Child measurements (one fresh process each)


def child_store(backend: str, holds: int, quick: bool, trace: bool) -> dict[str, Any]:
    """Build `holds` holds with upsert_many, then time walks."""
    factory = store_factory(backend)
    from inferencecache.index.store import PartitionOps

    wl = Workload()
    raw = factory()
    store = PartitionOps(raw)  # the backend's own capabilities, or the store.py defaults
    gc.collect()
    if trace:
        tracemalloc.start()
    base_rss = rss_bytes()
    base_traced = tracemalloc.get_traced_memory()[0] if trace else 0
    chains: list[int] = []
    ingest_ns = 0
    items = 0
    clock = time.perf_counter_ns
    ts = 1_000_000
    for i, packed, replicas in wl.placements(holds):
        keys = split(packed)
        for r in replicas:
            ts += 1
            t0 = clock()
            store.upsert_many(keys, CUMULATIVE, r, ts, 1)
            ingest_ns += clock() - t0
            items += len(keys)
        chains.append(i)
    del keys, packed
    gc.collect()
    out: dict[str, Any] = {
        "holds": store.hold_count(),
        "keys": store.key_count(),
        "chains": len(chains),
        "bytes_per_hold_rss": (rss_bytes() - base_rss) / store.hold_count(),
        "ingest_holds_per_s": items / (ingest_ns / 1e9),
    }
    if hasattr(raw, "memory_bytes"):
        out["bytes_per_hold_accounted"] = raw.memory_bytes() / store.hold_count()
    if trace:
        out["bytes_per_hold_tracemalloc"] = (
            tracemalloc.get_traced_memory()[0] - base_traced
        ) / store.hold_count()
        tracemalloc.stop()
        return out
    # Walks: a different stored chain each call (cold table), packed and list forms.
    rng = random.Random(SEED + 1)
    sample = [wl.chain(i) for i in rng.sample(chains, min(len(chains), 400))]
    lists = [split(p) for p in sample]
    misses = [rng.randbytes(CHAIN_BLOCKS * 8) for _ in range(64)]
    calls = 1500 if quick else 5000
    n = len(sample)
    walk = store.walk
    expect = walk(sample[0], COUNTS, 0)
    assert expect and max(r.blocks for r in expect) == CHAIN_BLOCKS, expect
    out["store_walk_512_p50_us"], out["store_walk_512_p99_us"] = timed(
        lambda j: walk(sample[j % n], COUNTS, 0), calls
    )
    out["store_walk_512_list_p50_us"], _ = timed(lambda j: walk(lists[j % n], COUNTS, 0), calls)
    out["store_walk_512_miss_p50_us"], _ = timed(lambda j: walk(misses[j % 64], COUNTS, 0), calls)
    out["store_walk_512_hot_p50_us"], _ = timed(lambda j: walk(sample[0], COUNTS, 0), calls)
    # Full scans: eviction candidates for the global cap, then a sweep that empties the store.
    t0 = clock()
    cands = store.cap_candidates(1000, True)
    out["cap_candidates_1k_ms"] = (clock() - t0) / 1e6
    for _count, _ts, key, replica in sorted(cands)[:1000]:  # evict them, as the index would
        store.remove_hold(key, replica)
    t0 = clock()
    store.cap_candidates(1000, True)
    out["cap_candidates_1k_next_ms"] = (clock() - t0) / 1e6
    t0 = clock()
    store.sweep(2**62)
    out["sweep_all_ms"] = (clock() - t0) / 1e6
    gc.collect()
    out["rss_left_after_sweep_mb"] = (rss_bytes() - base_rss) / 2**20
    return out


def child_index(backend: str, holds: int, quick: bool) -> dict[str, Any]:
    """Build through Index.apply_update, then time Router.lookup of stored chains."""
    from inferencecache.index import (
        Index,
        IndexConfig,
        IndexSettings,
        LookupRequest,
        Prefix,
        Reason,
        Router,
        Update,
    )

    factory = store_factory(backend)
    index = Index(IndexSettings(max_holds=0), store_factory=factory, config=IndexConfig())
    router = Router(index)
    wl = Workload()
    chains: list[int] = []
    items = 0
    t_ingest = time.perf_counter()

    def update(keys: list[bytes], r: int) -> Update:
        prefix = Prefix(block_hashes=keys, block_token_counts=COUNTS)
        return Update(
            replica_id=f"replica-{r}",
            model_id=MODEL,
            tenant_id=TENANT,
            hash_scheme=SCHEME,
            prefixes=[prefix],
        )

    for i, packed, replicas in wl.placements(holds):
        keys = split(packed)
        for r in replicas:
            index.apply_update(update(keys, r))
            items += len(keys)
        chains.append(i)
    t_ingest = time.perf_counter() - t_ingest
    rng = random.Random(SEED + 2)
    sample = [wl.chain(i) for i in rng.sample(chains, min(len(chains), 400))]
    reqs = [
        LookupRequest(
            tenant_id=TENANT,
            model_id=MODEL,
            hash_scheme=SCHEME,
            block_hashes=p,
            packed_hashes=True,
            block_token_counts=COUNTS,
        )
        for p in sample
    ]
    first = router.lookup(reqs[0])
    assert first.reason_code == Reason.PREFIX_MATCH, first
    calls = 1000 if quick else 3000
    n = len(reqs)
    p50, p99 = timed(lambda j: router.lookup(reqs[j % n]), calls)
    router.close()
    # Ingest with the global cap reached: every update now also evicts (contract-and-index.md §6.3).
    capped = Index(IndexSettings(max_holds=holds), store_factory=factory, config=IndexConfig())
    for _i, packed, replicas in wl.placements(holds):
        keys = split(packed)
        for r in replicas:
            capped.apply_update(update(keys, r))
    over_updates = 10 if quick else 50
    done = 0
    t_cap = time.perf_counter()
    for _i, packed, replicas in wl.placements(holds, start=len(chains)):
        keys = split(packed)
        for r in replicas:
            capped.apply_update(update(keys, r))
            done += 1
        if done >= over_updates:
            break
    t_cap = time.perf_counter() - t_cap
    return {
        "index_lookup_512_p50_us": p50,
        "index_lookup_512_p99_us": p99,
        "index_ingest_holds_per_s": items / t_ingest,
        "index_ingest_at_cap_holds_per_s": done * CHAIN_BLOCKS / t_cap,
    }


# ---------------------------------------------------------------------------------------------
# Orchestration


def _child(args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
    env = dict(os.environ)
    env.pop("INFERENCECACHE_PURE_PYTHON", None)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{done.stderr}")
    res: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return res


def run(quick: bool = False) -> dict[str, Any]:
    q = ["--quick"] if quick else []
    native_1m = _child(["store", "native", "1000000", *q])
    native_1m_trace = _child(["trace", "native", "1000000", *q])
    pure_1m = _child(["store", "pure", "1000000", *q])
    pure_1m_trace = _child(["trace", "pure", "1000000", *q])
    res: dict[str, Any] = {
        "bytes_per_hold_1m": native_1m["bytes_per_hold_rss"],
        "bytes_per_hold_1m_accounted": native_1m["bytes_per_hold_accounted"],
        "bytes_per_hold_1m_tracemalloc": native_1m_trace["bytes_per_hold_tracemalloc"],
        "store_walk_512_p50_us": native_1m["store_walk_512_p50_us"],
        "store_walk_512_p99_us": native_1m["store_walk_512_p99_us"],
        "store_walk_512_list_p50_us": native_1m["store_walk_512_list_p50_us"],
        "store_walk_512_miss_p50_us": native_1m["store_walk_512_miss_p50_us"],
        "store_walk_512_hot_p50_us": native_1m["store_walk_512_hot_p50_us"],
        "cap_candidates_1k_ms": native_1m["cap_candidates_1k_ms"],
        "cap_candidates_1k_next_ms": native_1m["cap_candidates_1k_next_ms"],
        "sweep_all_ms": native_1m["sweep_all_ms"],
        "rss_left_after_sweep_mb": native_1m["rss_left_after_sweep_mb"],
        "ingest_holds_per_s": native_1m["ingest_holds_per_s"],
        "holds_1m": native_1m["holds"],
        "keys_1m": native_1m["keys"],
    }
    if not quick:
        native_10m = _child(["store", "native", "10000000"])
        res["bytes_per_hold_10m"] = native_10m["bytes_per_hold_rss"]
        res["bytes_per_hold_10m_accounted"] = native_10m["bytes_per_hold_accounted"]
        res["holds_10m"] = native_10m["holds"]
        res["store_walk_512_p50_us_10m"] = native_10m["store_walk_512_p50_us"]
        res["ingest_holds_per_s_10m"] = native_10m["ingest_holds_per_s"]
        res["sweep_all_ms_10m"] = native_10m["sweep_all_ms"]
        res["rss_left_after_sweep_mb_10m"] = native_10m["rss_left_after_sweep_mb"]
    pure = {
        "bytes_per_hold_1m": pure_1m["bytes_per_hold_rss"],
        "bytes_per_hold_1m_tracemalloc": pure_1m_trace["bytes_per_hold_tracemalloc"],
        "store_walk_512_p50_us": pure_1m["store_walk_512_p50_us"],
        "store_walk_512_p99_us": pure_1m["store_walk_512_p99_us"],
        "store_walk_512_miss_p50_us": pure_1m["store_walk_512_miss_p50_us"],
        "ingest_holds_per_s": pure_1m["ingest_holds_per_s"],
        "cap_candidates_1k_ms": pure_1m["cap_candidates_1k_ms"],
        "cap_candidates_1k_next_ms": pure_1m["cap_candidates_1k_next_ms"],
        "sweep_all_ms": pure_1m["sweep_all_ms"],
        "rss_left_after_sweep_mb": pure_1m["rss_left_after_sweep_mb"],
    }
    try:
        index_native = _child(["index", "native", "1000000", *q])
        index_pure = _child(["index", "pure", "1000000", *q])
    except RuntimeError as e:  # the index layer is not importable in this tree
        res["index_error"] = str(e).splitlines()[-1]
    else:
        res.update(index_native)
        pure.update(index_pure)
    res["pure"] = pure
    ratio = {}
    for k, v in pure.items():
        if k in res and isinstance(res[k], float) and res[k] and v:
            # how many times better the compiled store is (throughput: higher is better)
            ratio[k] = res[k] / v if k.endswith("_per_s") else v / res[k]
    res["ratio"] = ratio
    return res


def _report(res: dict[str, Any]) -> str:
    pure = res.get("pure", {})
    ratio = res.get("ratio", {})
    lines = [f"{'figure':36} {'compiled':>12} {'pure-Python':>12} {'compiled gain':>14}"]
    for k, v in res.items():
        if isinstance(v, dict):
            continue
        p = pure.get(k)
        r = ratio.get(k)
        cell = f"{v:12.2f}" if isinstance(v, float) else f"{v!s:>12}"
        pcell = f"{p:12.2f}" if isinstance(p, float) else f"{'':>12}"
        rcell = f"{r:13.2f}x" if isinstance(r, float) else ""
        lines.append(f"{k:36} {cell} {pcell} {rcell}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1M holds only, fewer calls")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--child", nargs=3, metavar=("MODE", "BACKEND", "HOLDS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        mode, backend, holds = args.child
        if mode == "index":
            out = child_index(backend, int(holds), args.quick)
        else:
            out = child_store(backend, int(holds), args.quick, trace=mode == "trace")
        print(json.dumps(out))
        return
    res = run(args.quick)
    print(json.dumps(res, indent=2) if args.json else _report(res))


if __name__ == "__main__":
    main()
