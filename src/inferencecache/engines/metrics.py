"""vLLM-named Prometheus metrics of a fake or simulated engine, served at ``/metrics``.

The names and types are the ones the subscriber's stats path reads
(engine-events-and-subscriber.md §7), with vLLM's labels (``model_name``, ``engine``), so a
subscriber scrapes a fake engine exactly like a real one.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from inferencecache.metrics import metrics_response
from inferencecache.subscriber.engine_stats import (
    EXT_HITS,
    EXT_QUERIES,
    HITS,
    KV_USAGE,
    QUERIES,
    RUNNING,
    WAITING,
)
from inferencecache.supervise import Drops, drop_counter
from inferencecache.web import Listener

CACHE_CONFIG_INFO = "vllm:cache_config_info"


class EngineMetrics:
    """The gauges and counters vLLM exposes, bound to one model name."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        block_size: int | None = None,
    ) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        if block_size is not None:  # vLLM's info gauge of its CacheConfig (a subset of labels)
            Gauge(
                CACHE_CONFIG_INFO,
                "Information of the LLMEngine CacheConfig",
                ("block_size", "enable_prefix_caching", "engine"),
                registry=r,
            ).labels(str(block_size), "True", "0").set(1)
        labels = ("model_name", "engine")
        values = (model_name, "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        self.kv_cache_usage = gauge(KV_USAGE, "KV-cache usage (1 = full).")
        self.running = gauge(RUNNING, "Requests running.")
        self.waiting = gauge(WAITING, "Requests waiting.")
        self.prefix_cache_hits = counter(HITS, "Prefix-cache hit tokens.")
        self.prefix_cache_queries = counter(
            QUERIES, "Prefix-cache queried tokens."
        )
        self.external_hits = counter(
            EXT_HITS, "External (connector) prefix-cache hit tokens."
        )
        self.external_queries = counter(
            EXT_QUERIES, "External prefix-cache queried tokens."
        )
        # disaggregated prefill/decode handoffs (ours, not vLLM's): {side, peer}
        self.kv_transfers = Counter(
            "inferencecache_engine_kv_transfers",
            "Requests with kv_transfer_params: side=producer (prefilled for a remote decode) or "
            "consumer (decoded from the KV of remote engine `peer`).",
            ["side", "peer"],
            registry=r,
        )
        # HTTP requests whose handling raised unexpectedly (ours, not vLLM's): {loop, reason}
        self.drops = Drops(
            drop_counter("inferencecache_engine_", r), logging.getLogger("inferencecache.engines")
        )


class MetricsPage(Listener):
    """``/metrics`` (and vLLM's ``/health``) on one aiohttp listener."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        super().__init__(web.Application())
        self.routes(self.app)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return metrics_response(self.metrics.registry)

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    def routes(self, app: web.Application) -> None:
        """Add the routes to an app (the simulated engine serves more on its own)."""
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
