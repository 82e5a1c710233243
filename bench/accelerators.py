"""What each compiled accelerator buys at the service level: CPU per request with it forced off.

    python bench/accelerators.py [--rounds N] [--only index._rank,...] [--json]

For each accelerator (``INFERENCECACHE_PURE_PYTHON=<name>``, and once with none forced off),
rounds interleaved:

- a real ``inferencecache serve`` (its own process) holding a 512-block chain on 4 replicas:
  server CPU (``/proc`` utime + stime) per ``LookupRoute`` with the chain and with 8,192
  ``token_ids``, and per block of ``ReportCacheState`` updates of 4,096 legacy entries;
- the subscriber in process (``bench/e2e_ingest.py``): decode + map, and decode + map + encode,
  blocks per CPU second.

CPU time instead of latency: on a shared 2-core machine latency medians move by 2× between runs,
CPU per request much less. The medians over the rounds are the figures of ``docs/decisions.md``.
Every child is stopped by its own PID (``inferencecache.procs.Children``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import statistics
import subprocess
from typing import Any

ACCELERATORS = (
    "index._blockmap",
    "index._rank",
    "fingerprint._native",
    "server._lookupwire",
    "updatewire._native",
    "kvevents._native",
)
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def server_figures(lookups: int = 1500, updates: int = 60) -> dict[str, float]:
    """Server CPU per request of a fresh ``serve`` (whatever INFERENCECACHE_PURE_PYTHON says)."""
    import grpc

    from inferencecache import fingerprint
    from inferencecache.procs import Children
    from inferencecache.v1alpha1 import inferencecache_pb2 as pb
    from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

    out: dict[str, float] = {}
    with Children() as children:
        p = children.start("serve", "--grpc-address", "127.0.0.1:0", "--http-address",
                           "127.0.0.1:0", "--max-holds", "0")  # fmt: skip
        rec = p.wait_log("serving")
        port = int(rec["grpc_address"].rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
            toks = list(range(1000, 9192))
            hashes, counts = fingerprint.chain(toks, 16)
            for r in range(4):
                u = pb.CacheStateUpdate(replica_id=f"r{r}", model_id="m", tenant_id="t",
                                        hash_scheme="vllm")  # fmt: skip
                for i, h in enumerate(hashes[: 512 - 64 * r]):
                    u.prefixes.add(prefix_hash=h, token_count=16 * (i + 1), tier=1)  # type: ignore[arg-type]
                stub.ReportCacheState(iter([u]), timeout=30)
            chain = pb.LookupRouteRequest(model_id="m", tenant_id="t", hash_scheme="vllm",
                                          block_hashes=hashes, block_token_counts=counts)
            tokens = pb.LookupRouteRequest(model_id="m", tenant_id="t", hash_scheme="vllm",
                                           token_ids=toks)  # fmt: skip
            if len(stub.LookupRoute(chain, timeout=10).replica_scores) != 4:
                raise AssertionError("the 4 replicas holding the chain were not found")
            for name, req in (("chain", chain), ("tokens", tokens)):
                for _ in range(100):
                    stub.LookupRoute(req, timeout=10)
                c0 = _cpu_s(p.pid)
                for _ in range(lookups):
                    stub.LookupRoute(req, timeout=10)
                out[f"server_cpu_us_lookup_{name}"] = (_cpu_s(p.pid) - c0) / lookups * 1e6
            bodies = []
            for k in range(updates + 5):
                u = pb.CacheStateUpdate(replica_id=f"w{k % 8}", model_id="m2", tenant_id="t",
                                        hash_scheme="vllm")  # fmt: skip
                for i in range(4096):
                    u.prefixes.add(prefix_hash=(k * 4096 + i).to_bytes(8, "big"),
                                   token_count=16, tier=1)  # type: ignore[arg-type]  # fmt: skip
                bodies.append(u.SerializeToString())
            report = ch.stream_unary("/inferencecache.v1alpha1.InferenceCache/ReportCacheState")
            report(iter(bodies[:5]), timeout=60)
            c0 = _cpu_s(p.pid)
            report(iter(bodies[5:]), timeout=300)
            out["server_cpu_us_per_ingested_block"] = (_cpu_s(p.pid) - c0) / (updates * 4096) * 1e6
    return out


def subscriber_figures() -> dict[str, float]:
    from bench.e2e_ingest import _in_process

    res = _in_process(200_000)
    return {k: float(v) for k, v in res.items() if k.startswith("subscriber_") and "per_s" in k}


def _one(off: str) -> dict[str, float]:
    """Both measurements in a fresh interpreter with ``off`` forced to Python."""
    env = dict(os.environ)
    env.pop("INFERENCECACHE_PURE_PYTHON", None)
    if off != "none":
        env["INFERENCECACHE_PURE_PYTHON"] = off
    code = ("import json, bench.accelerators as a; "
            "print(json.dumps({**a.server_figures(), **a.subscriber_figures()}))")  # fmt: skip
    root = str(Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=900, check=True)  # fmt: skip
    figures: dict[str, float] = json.loads(res.stdout.strip().splitlines()[-1])
    return figures


def run(rounds: int = 3, only: tuple[str, ...] = ACCELERATORS) -> dict[str, Any]:
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in ("none", *only)}
    for _ in range(rounds):
        for name in samples:
            samples[name].append(_one(name))
    out: dict[str, Any] = {}
    for name, runs in samples.items():
        out[name] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(ACCELERATORS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.rounds, tuple(x for x in args.only.split(",") if x))
    if args.json:
        print(json.dumps(res, indent=2))
        return
    keys = list(res["none"])
    heads = (k.removeprefix("server_cpu_us_") for k in keys)
    print(f"{'forced off':22s} " + " ".join(f"{h:>28s}" for h in heads))
    for name, figs in res.items():
        print(f"{name:22s} " + " ".join(f"{figs[k]:28.2f}" for k in keys))


if __name__ == "__main__":
    main()
