"""The subscriber's own HTTP listener: Prometheus ``/metrics`` and ``/healthz``
(engine-events-and-subscriber.md §10)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from inferencecache.metrics import metrics_response
from inferencecache.web import Listener


class MetricsServer(Listener):
    """Serves ``registry`` and a health probe: 200 ``ok`` while ``health()`` is None, else 503
    with its text (e.g. ``degraded: processor restarting after 1 failure(s): ...``)."""

    def __init__(self, registry: CollectorRegistry, health: Callable[[], str | None]) -> None:
        self.registry = registry
        self.health = health
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        super().__init__(app)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return metrics_response(self.registry)

    async def _healthz(self, _request: web.Request) -> web.Response:
        problem = self.health()
        if problem is None:
            return web.Response(text="ok")
        return web.Response(status=503, text=problem)
