"""The oracle policy's view: ask every engine how much of a prompt it has cached right now.

HTTP contract (docs/gateway.md, implemented by the simulated engine):
``POST /debug/cache/match`` with ``{"model": <request model>, "tokens": [ids...]}`` answers
``200 {"matched_tokens": n}``: the number of leading prompt tokens whose full blocks the
engine's prefix cache holds for that model/adapter, without touching LRU order or metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Final

import aiohttp

from inferencecache.gateway.engines import EnginePool
from inferencecache.gateway.metrics import GatewayMetrics

ORACLE_PATH: Final = "/debug/cache/match"


async def query_oracle(
    session: aiohttp.ClientSession,
    pool: EnginePool,
    replicas: Sequence[str],
    model: str,
    tokens: Sequence[int],
    timeout: float,
    metrics: GatewayMetrics,
) -> tuple[dict[str, int] | None, float]:
    """replica -> cached prefix tokens (an engine that fails counts 0; all fail: None), seconds."""
    body = json.dumps({"model": model, "tokens": list(tokens)}).encode()
    limit = aiohttp.ClientTimeout(total=timeout)

    async def one(rid: str) -> int | None:
        try:
            async with session.post(
                pool.engines[rid].url(ORACLE_PATH),
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=limit,
            ) as resp:
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
                payload = await resp.json(content_type=None)
            n = payload.get("matched_tokens") if isinstance(payload, dict) else None
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError("no matched_tokens")
            return n
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            metrics.upstream_errors(rid, "oracle").inc()
            return None

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(r) for r in replicas))
    elapsed = time.perf_counter() - t0
    if all(r is None for r in results):
        return None, elapsed
    return {rid: (n or 0) for rid, n in zip(replicas, results, strict=True)}, elapsed
