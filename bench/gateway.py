"""What the reference gateway adds to a request: proxy overhead and the LookupRoute round trip.

    python bench/gateway.py [--quick] [--json]

Starts, each in its own process on loopback ports chosen at run time: ``inferencecache serve``,
two ``fake-engine --mode simulated`` engines with zero prefill/decode cost (so the engine's
own time is just its HTTP handling), and one ``gateway`` per routing policy measured. The
client (this process, aiohttp, concurrency 1, keep-alive) sends the same non-streaming
``/v1/completions`` request (a 1024-token prompt, ``max_tokens`` 1) directly to an engine and
through the gateway, interleaved so drift hits both alike, and reports the latency p50/p90 of
each and the difference, plus the gateway's own ``X-Cache-Route-Hint-Us`` (LookupRoute round
trip seen by the gateway) and ``X-Cache-Route-Overhead-Us`` (arrival to dispatch) p50s. The
index holds the prompt's chain for one replica, so ``cache_aware`` gets PREFIX_MATCH answers.
Everything it starts is stopped by PID at the end. ``run(quick)`` returns the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inferencecache import fingerprint  # noqa: E402
from inferencecache.procs import Children  # noqa: E402
from inferencecache.v1alpha1 import inferencecache_pb2 as pb  # noqa: E402
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc  # noqa: E402

BLOCK = 16
MODEL = "bench-model"
PROMPT = list(range(10_000, 10_000 + 1024))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(direct: str, via: str, n: int) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    lat: dict[str, list[float]] = {"direct": [], "gateway": []}
    hint_us: list[int] = []
    overhead_us: list[int] = []
    reasons: dict[str, int] = {}
    async with aiohttp.ClientSession() as s:

        async def one(url: str, key: str, record: bool) -> None:
            t0 = time.perf_counter()
            async with s.post(url, data=body, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
                if key == "gateway" and record:
                    if "X-Cache-Route-Hint-Us" in r.headers:
                        hint_us.append(int(r.headers["X-Cache-Route-Hint-Us"]))
                    overhead_us.append(int(r.headers["X-Cache-Route-Overhead-Us"]))
                    reason = r.headers["X-Cache-Route-Reason"]
                    reasons[reason] = reasons.get(reason, 0) + 1
            if record:
                lat[key].append(time.perf_counter() - t0)

        for i in range(n + 50):
            record = i >= 50  # warm-up
            await one(f"http://{direct}/v1/completions", "direct", record)
            await one(f"http://{via}/v1/completions", "gateway", record)
    d50, g50 = statistics.median(lat["direct"]), statistics.median(lat["gateway"])
    return {
        "requests": n,
        "direct_p50_ms": round(d50 * 1e3, 3),
        "direct_p90_ms": round(pct(lat["direct"], 0.9) * 1e3, 3),
        "gateway_p50_ms": round(g50 * 1e3, 3),
        "gateway_p90_ms": round(pct(lat["gateway"], 0.9) * 1e3, 3),
        "added_p50_ms": round((g50 - d50) * 1e3, 3),
        "hint_rtt_p50_ms": round(statistics.median(hint_us) / 1e3, 3) if hint_us else None,
        "hint_rtt_p90_ms": round(pct([float(x) for x in hint_us], 0.9) / 1e3, 3)
        if hint_us else None,
        "pre_dispatch_p50_ms": round(statistics.median(overhead_us) / 1e3, 3),
        "reasons": reasons,
    }


def run(quick: bool = False) -> dict[str, Any]:
    n = 300 if quick else 2000
    with Children() as procs:
        server = procs.start("serve", "--grpc-address", "127.0.0.1:0",
                             "--http-address", "127.0.0.1:0", "--lookup-http-address",
                             "127.0.0.1:0", "--block-size", str(BLOCK))
        rec = server.wait_log("serving", timeout=30)
        grpc_address = rec["grpc_address"]
        lookup_url = f"http://{rec['lookup_http_address']}"
        engines = []
        for _ in range(2):
            e = procs.start("fake-engine", "--mode", "simulated",
                            "--bind", "tcp://127.0.0.1:0", "--http-address", "127.0.0.1:0",
                            "--block-size", str(BLOCK), "--model-name", MODEL,
                            "--gpu-blocks", "4096", "--prefill-ms-per-token", "0",
                            "--decode-ms-per-token", "0", "--prefill-base-ms", "0")
            engines.append(e.wait_log("simulated engine ready", timeout=30)["http_address"])
        hashes, counts = fingerprint.chain(PROMPT, BLOCK)
        with grpc.insecure_channel(grpc_address) as ch:
            stub = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
            stub.ReportCacheState(iter([pb.CacheStateUpdate(
                replica_id="r0", model_id=MODEL, tenant_id="default", hash_scheme="vllm",
                prefixes=[pb.PrefixEntry(block_hashes=hashes, block_token_counts=counts,
                                         tier=pb.CACHE_TIER_T1)],
            ), pb.CacheStateUpdate(
                replica_id="r1", model_id=MODEL, tenant_id="default", hash_scheme="vllm",
                prefixes=[pb.PrefixEntry(block_hashes=hashes[:1], block_token_counts=counts[:1],
                                         tier=pb.CACHE_TIER_T1)],
            )]), timeout=10)
        flag = f"r0=http://{engines[0]},r1=http://{engines[1]}"
        out: dict[str, Any] = {"prompt_tokens": len(PROMPT), "block_size": BLOCK}
        # the hint transports, interleaved: gRPC (--server) and HTTP (--lookup-url)
        variants = {"round_robin": [], "cache_aware": [], "cache_aware_http": ["--lookup-url",
                                                                               lookup_url]}
        for name, extra in variants.items():
            policy = name.removesuffix("_http")
            gw = procs.start("gateway", "--engines", flag, "--server", grpc_address,
                             "--http-address", "127.0.0.1:0", "--routing-policy", policy,
                             "--block-size", str(BLOCK), *extra)
            addr = gw.wait_log("serving", timeout=30)["http_address"]
            out[name] = asyncio.run(measure(engines[0], addr, n))
            procs.stop(gw)
        out["gateway_hint_grpc_p50_ms"] = out["cache_aware"]["hint_rtt_p50_ms"]
        out["gateway_hint_http_p50_ms"] = out["cache_aware_http"]["hint_rtt_p50_ms"]
        out["gateway_added_p50_ms"] = out["cache_aware_http"]["added_p50_ms"]
        # what the demo's gateways use (the HTTP path, the cheaper one): docs/gateway.md
        out["demo_hint_overhead_p50_ms"] = out["gateway_hint_http_p50_ms"]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.quick)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    for policy in ("round_robin", "cache_aware", "cache_aware_http"):
        r = res[policy]
        print(
            f"{policy:12s} direct p50 {r['direct_p50_ms']:.3f} ms  via gateway p50 "
            f"{r['gateway_p50_ms']:.3f} ms  added p50 {r['added_p50_ms']:.3f} ms  "
            f"pre-dispatch p50 {r['pre_dispatch_p50_ms']:.3f} ms  hint RTT p50 "
            f"{r['hint_rtt_p50_ms']} ms  reasons {r['reasons']}"
        )


if __name__ == "__main__":
    main()
