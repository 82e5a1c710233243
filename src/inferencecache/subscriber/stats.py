"""The stats path (engine-events-and-subscriber.md §7): engine ``/metrics`` → ``ReplicaStats`` every
interval.

Independent of the event path; it only shares the gRPC client. Two profiles read the engine's
Prometheus text: vLLM (the origin's rules, hit rate from counter deltas between scrapes) and
SGLang (``--hash-scheme sglang``: gauges read directly). A tick that does not deliver counts as a
failure; the third consecutive one is logged once as an Error (``event=load_signal_stale``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from inferencecache import __version__
from inferencecache.subscriber.client import CacheClient, describe_error
from inferencecache.subscriber.engine_stats import (
    CPU_USAGE,
    EXT_HITS,
    EXT_QUERIES,
    GPU_USAGE,
    HITS,
    KV_USAGE,
    QUERIES,
    RUNNING,
    WAITING,
    clamp01,
    delta_hit_rate,
    pressure,
)
from inferencecache.subscriber.messages import Identity
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.supervise import describe
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

log = logging.getLogger("inferencecache.subscriber")

SCRAPE_TIMEOUT: Final = 5.0
STALE_THRESHOLD: Final = 3

SGL_RUNNING: Final = "sglang:num_running_reqs"
SGL_QUEUE: Final = "sglang:num_queue_reqs"
SGL_USAGE: Final = "sglang:token_usage"
SGL_HIT_RATE: Final = "sglang:cache_hit_rate"
SGL_FAMILIES: Final = (SGL_RUNNING, SGL_QUEUE, SGL_USAGE, SGL_HIT_RATE)


class StatsError(Exception):
    """The scrape or its content cannot give stats: the tick fails."""


@dataclass(frozen=True, slots=True)
class StatsValues:
    """What one tick reports (``ReplicaStats`` fields)."""

    cache_memory_bytes: int = 0
    hit_rate: float = 0.0
    pressure: float = 0.0
    t2_hit_tokens: int = 0
    t2_query_tokens: int = 0


class Families:
    """Parsed exposition, indexed by family name, with the ``model_name`` series filter."""

    def __init__(self, text: str, model_name: str = "") -> None:
        self.model_name = model_name
        self.by_name: dict[str, Any] = {}
        try:
            for fam in text_string_to_metric_families(text):
                self.by_name.setdefault(fam.name, fam)
        except Exception as e:  # the parser raises ValueError and friends on bad text
            raise StatsError(f"cannot parse metrics: {e}") from None

    def _match(self, labels: dict[str, str]) -> bool:
        return not self.model_name or labels.get("model_name") == self.model_name

    def series(self, name: str, kind: str) -> list[tuple[dict[str, str], float]]:
        """Matching samples of the ``kind``-typed family ``name`` (counters: ``_total``)."""
        fam = self.by_name.get(name)
        if fam is None or fam.type != kind:
            return []
        sample_name = name + "_total" if kind == "counter" else name
        return [
            (s.labels, float(s.value))
            for s in fam.samples
            if s.name == sample_name and self._match(s.labels)
        ]

    def counter(self, name: str) -> float | None:
        """Sum of the matching series of a counter, ``None`` when there is none."""
        values = self.series(name, "counter")
        return sum(v for _, v in values) if values else None

    def gauge(self, name: str) -> float | None:
        """The first matching series of a gauge, ``None`` when there is none."""
        values = self.series(name, "gauge")
        return values[0][1] if values else None


class Profile(Protocol):
    def compute(self, fams: Families) -> StatsValues: ...


def _finite(x: float | None) -> float:
    return x if x is not None and math.isfinite(x) else 0.0


def _memory(usage: float, size: int) -> int:
    if size <= 0 or not math.isfinite(usage):
        return 0
    return int(usage * size)


class VllmProfile:
    """vLLM metric names; hit rate from prefix-cache counter deltas between scrapes."""

    def __init__(self, cache_tier: str, cache_size_bytes: int, ceiling: int) -> None:
        self.cache_tier = cache_tier
        self.cache_size_bytes = cache_size_bytes
        self.ceiling = ceiling
        self._baseline: tuple[float, float] | None = None

    def _usage(self, f: Families) -> float:
        kv, gpu, cpu = f.gauge(KV_USAGE), f.gauge(GPU_USAGE), f.gauge(CPU_USAGE)
        if self.cache_tier == "kv":
            return _finite(kv)
        if self.cache_tier == "gpu":
            return _finite(gpu)
        if self.cache_tier == "cpu":
            return _finite(cpu)
        if kv is not None:
            return _finite(kv)
        present = [_finite(x) for x in (gpu, cpu) if x is not None]
        return max(present) if present else 0.0

    def _hit_rate(self, f: Families) -> float:
        hits, queries = f.counter(HITS), f.counter(QUERIES)
        if hits is None or queries is None:
            return 0.0  # baseline kept
        base = self._baseline
        self._baseline = (hits, queries)
        if base is None:
            return 0.0
        return delta_hit_rate(hits - base[0], queries - base[1])  # a reset: rebased above

    def compute(self, fams: Families) -> StatsValues:
        load = _finite(fams.gauge(RUNNING)) + _finite(fams.gauge(WAITING))
        return StatsValues(
            cache_memory_bytes=_memory(self._usage(fams), self.cache_size_bytes),
            hit_rate=self._hit_rate(fams),
            pressure=pressure(load, self.ceiling),
            t2_hit_tokens=int(_finite(fams.counter(EXT_HITS))),
            t2_query_tokens=int(_finite(fams.counter(EXT_QUERIES))),
        )


class SglangProfile:
    """SGLang metric names (``--hash-scheme sglang``); every value read directly."""

    def __init__(self, cache_tier: str, cache_size_bytes: int, ceiling: int) -> None:
        self.cache_tier = cache_tier
        self.cache_size_bytes = cache_size_bytes
        self.ceiling = ceiling

    @staticmethod
    def _values(fams: Families, name: str, skip_priority: bool = False) -> list[float]:
        out = []
        for labels, value in fams.series(name, "gauge"):
            if skip_priority and labels.get("priority", ""):
                continue
            if math.isfinite(value):
                out.append(value)
        return out

    def compute(self, fams: Families) -> StatsValues:
        if not any(name in fams.by_name for name in SGL_FAMILIES):
            raise StatsError("no sglang:* metrics in the response (is --enable-metrics on?)")
        running = self._values(fams, SGL_RUNNING, skip_priority=True)
        queued = self._values(fams, SGL_QUEUE, skip_priority=True)
        if not running or not queued:
            missing = SGL_RUNNING if not running else SGL_QUEUE
            raise StatsError(f"no matching series of {missing}")
        usage = 0.0
        if self.cache_tier in ("auto", "kv"):
            usages = self._values(fams, SGL_USAGE)
            usage = max(usages) if usages else 0.0
        rates = self._values(fams, SGL_HIT_RATE)
        return StatsValues(
            cache_memory_bytes=_memory(usage, self.cache_size_bytes),
            hit_rate=clamp01(max(rates)) if rates else 0.0,
            pressure=pressure(sum(running) + sum(queued), self.ceiling),
        )


def make_profile(hash_scheme: str, cache_tier: str, cache_size_bytes: int, ceiling: int) -> Profile:
    """The SGLang profile for ``sglang``, else vLLM (an unknown scheme is warned once)."""
    if hash_scheme == "sglang":
        return SglangProfile(cache_tier, cache_size_bytes, ceiling)
    if hash_scheme != "vllm":
        log.warning(
            "unknown --hash-scheme; reading engine stats with the vLLM profile",
            extra={"hash_scheme": hash_scheme},
        )
    return VllmProfile(cache_tier, cache_size_bytes, ceiling)


def build_stats_update(ident: Identity, values: StatsValues, now: float) -> pb.CacheStateUpdate:
    """A stats-only update: no prefixes, ``stats.replica_id`` mirrored, wall-clock timestamp."""
    return pb.CacheStateUpdate(
        replica_id=ident.replica_id,
        model_id=ident.model_id,
        tenant_id=ident.tenant_id,
        hash_scheme=ident.hash_scheme,
        timestamp_us=int(now * 1e6),
        stats=pb.ReplicaStats(
            replica_id=ident.replica_id,
            cache_memory_bytes=values.cache_memory_bytes,
            hit_rate=values.hit_rate,
            pressure=values.pressure,
            client_version=f"inferencecache-subscriber/{__version__}",
            t2_hit_tokens=values.t2_hit_tokens,
            t2_query_tokens=values.t2_query_tokens,
        ),
    )


class StatsReporter:
    """Scrape, compute, send, every interval (first tick after one interval)."""

    def __init__(
        self,
        client: CacheClient,
        ident: Identity,
        metrics: SubscriberMetrics,
        profile: Profile,
        *,
        url: str,
        interval: float,
        model_name: str = "",
        scrape_timeout: float = SCRAPE_TIMEOUT,
        on_scrape: Callable[[float], None] | None = None,
    ) -> None:
        """``on_scrape(time.monotonic())`` after each answered scrape (engine liveness)."""
        self.on_scrape = on_scrape
        self.client = client
        self.ident = ident
        self.metrics = metrics
        self.profile = profile
        self.url = url
        self.interval = interval
        self.model_name = model_name
        self.scrape_timeout = scrape_timeout
        self.failures = 0
        self.delivered = False
        self._session: aiohttp.ClientSession | None = None

    async def scrape(self) -> str:
        """GET the engine's metrics page; :class:`StatsError` unless it answers 200 in time."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.scrape_timeout)
            )
        try:
            async with self._session.get(self.url) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise StatsError(f"GET {self.url}: HTTP {resp.status}")
                return body
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as e:
            raise StatsError(f"GET {self.url}: {type(e).__name__}: {e}") from None

    async def tick(self) -> bool:
        """One scrape-and-send; ``True`` when the stats were delivered and accepted."""
        try:
            text = await self.scrape()
            if self.on_scrape is not None:
                self.on_scrape(time.monotonic())
            values = self.profile.compute(Families(text, self.model_name))
        except StatsError as e:
            self._failed("scrape_failed", str(e))
            return False
        except Exception as e:  # whatever else the engine's page makes raise: this tick only
            self.metrics.drops.drop("stats", e, url=self.url)
            self._failed("scrape_failed", describe(e))
            return False
        update = build_stats_update(self.ident, values, time.time())
        try:
            ack = await self.client.report(update)
        except Exception as e:
            self.metrics.rpc_failures["stats"].inc()
            self._failed("send_failed", describe_error(e))
            return False
        if not ack.accepted:
            self._failed("rejected", f"server did not accept the stats ({ack.reason_code})")
            return False
        self._succeeded()
        return True

    def _failed(self, result: str, err: str) -> None:
        self.failures += 1
        self.metrics.stats_ticks[result].inc()
        n = self.failures
        extra = {"err": err, "consecutive_failures": n}
        if n < STALE_THRESHOLD:
            log.warning("engine load stats update failed; will retry", extra=extra)
        elif n == STALE_THRESHOLD:
            msg = (
                "engine load signal is stale; the server keeps routing on the last stats"
                if self.delivered
                else "engine load signal was never delivered; the server has no stats for "
                "this replica"
            )
            log.error(msg, extra={**extra, "event": "load_signal_stale"})
        else:
            log.debug("engine load stats update failed", extra=extra)

    def _succeeded(self) -> None:
        self.metrics.stats_ticks["ok"].inc()
        if self.failures >= STALE_THRESHOLD:
            log.info(
                "engine load signal recovered",
                extra={"event": "load_signal_recovered", "after_failures": self.failures},
            )
        self.failures = 0
        self.delivered = True

    async def run(self) -> None:
        """Tick every interval until cancelled."""
        log.info("stats reporter starting", extra={"url": self.url, "interval_s": self.interval})
        try:
            while True:
                await asyncio.sleep(self.interval)
                await self.tick()
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None  # a supervised restart opens a new one
            log.info("stats reporter stopped")
