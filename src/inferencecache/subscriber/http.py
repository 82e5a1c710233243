"""The subscriber's own HTTP listener: Prometheus ``/metrics`` and ``/healthz`` (spec §10)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class MetricsServer:
    """Serves ``registry`` and a health probe that answers 200 ``ok`` while ``healthy()``."""

    def __init__(self, registry: CollectorRegistry, healthy: Callable[[], bool]) -> None:
        self.registry = registry
        self.healthy = healthy
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _request: web.Request) -> web.Response:
        if self.healthy():
            return web.Response(text="ok")
        return web.Response(status=503, text="not running")

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port (useful with port 0)."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host or None, port, reuse_address=True)
        await site.start()
        self._runner = runner
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
