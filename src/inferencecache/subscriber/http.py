"""The subscriber's own HTTP listener: Prometheus ``/metrics`` and ``/healthz``
(engine-events-and-subscriber.md §10)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from inferencecache.metrics import metrics_response
from inferencecache.web import Listener


class MetricsServer(Listener):
    """Serves ``registry`` and a health probe that answers 200 ``ok`` while ``healthy()``."""

    def __init__(self, registry: CollectorRegistry, healthy: Callable[[], bool]) -> None:
        self.registry = registry
        self.healthy = healthy
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        super().__init__(app)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return metrics_response(self.registry)

    async def _healthz(self, _request: web.Request) -> web.Response:
        if self.healthy():
            return web.Response(text="ok")
        return web.Response(status=503, text="not running")
