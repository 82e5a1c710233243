"""HTTP surfaces (contract-and-index.md §9.2): health, readiness, metrics and the admin paths.

aiohttp runs on its own asyncio loop in one thread, on sockets bound by the caller (so a bind
error is reported before anything starts). The admin handlers run their index work in the
default executor so a large ``/snapshot`` never stalls ``/healthz``. With auth enabled the bearer
check runs before the method check: an unauthenticated ``POST /snapshot`` is 401, not 405.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry

from inferencecache.eventlog import LogUnavailable
from inferencecache.metrics import LazyChildren, metrics_response
from inferencecache.server.auth import OK, BearerAuth
from inferencecache.server.live import MAX_LOOKUP_BODY, LiveView, LookupInputError, page_html
from inferencecache.server.metrics import ServerMetrics
from inferencecache.supervise import Drops
from inferencecache.web import LoopThread, guard_middleware, read_limited

log = logging.getLogger("inferencecache.server.http")

MAX_POLICY_BODY = 1024 * 1024
"""``/policy`` bodies above 1 MiB are rejected with 400 (contract-and-index.md §9.4)."""
MAX_PROBE_BODY = 4 * 1024
"""``/probe`` bodies above 4 KiB are rejected with 400 (contract-and-index.md §9.5)."""


class AdminBackend(Protocol):
    """What the admin paths need from the server core (blocking calls, run off the loop)."""

    def snapshot_json(self) -> bytes: ...

    def replace_policy(self, body: bytes) -> str | None:
        """Apply a ``/policy`` body; None on success, else the 400 message."""
        ...

    def probe(self, body: bytes) -> tuple[int, bytes]:
        """Run the self-test; (HTTP status, JSON body)."""
        ...


@dataclass
class HttpConfig:
    registry: CollectorRegistry
    metrics: ServerMetrics
    auth: BearerAuth
    backend: AdminBackend
    ready: Callable[[], bool]
    health: Callable[[], str | None] = lambda: None
    live: LiveView | None = None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _text(status: int, text: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=text, content_type="text/plain", headers=headers)


def _public_routes(app: web.Application, cfg: HttpConfig) -> None:
    async def healthz(request: web.Request) -> web.Response:
        problem = cfg.health()
        return _text(200, "ok\n") if problem is None else _text(503, problem + "\n")

    async def readyz(request: web.Request) -> web.Response:
        return _text(200, "ok\n") if cfg.ready() else _text(503, "not ready\n")

    async def metrics(request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, metrics_response, cfg.registry)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)


def _admin_routes(app: web.Application, cfg: HttpConfig) -> None:
    def guarded(endpoint: str, methods: tuple[str, ...], inner: Handler) -> Handler:
        children = LazyChildren(cfg.metrics.auth[endpoint])

        async def handler(request: web.Request) -> web.StreamResponse:
            result = cfg.auth.check(request.headers.get("Authorization"))
            children(result).inc()
            if result != OK:
                return _text(401, "unauthorized\n", {"WWW-Authenticate": "Bearer"})
            if request.method not in methods:
                return _text(405, "method not allowed\n", {"Allow": ", ".join(methods)})
            return await inner(request)

        return handler

    async def snapshot(request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(None, cfg.backend.snapshot_json)
        return web.Response(body=body, content_type="application/json")

    def rejected(request: web.Request, endpoint: str, reason: str, detail: str) -> None:
        """A bad admin body: counted and logged (admin traffic is rare, so every one)."""
        cfg.metrics.admin_rejected.labels(endpoint, reason).inc()
        log.warning(
            "admin request rejected",
            extra={"endpoint": f"/{endpoint}", "reason": reason, "detail": detail[:200],
                   "peer": request.remote or ""},
        )

    async def read_body(request: web.Request, endpoint: str, limit: int) -> bytes | web.Response:
        """The request body, or the 400 answer when it is larger than ``limit`` bytes."""
        body = await read_limited(request, limit)
        if body is None:
            msg = f"{endpoint} body larger than {limit} bytes"
            rejected(request, endpoint, "too_large", msg)
            return _text(400, msg + "\n")
        return body

    async def policy(request: web.Request) -> web.Response:
        body = await read_body(request, "policy", MAX_POLICY_BODY)
        if isinstance(body, web.Response):
            return body
        loop = asyncio.get_running_loop()
        try:
            err = await loop.run_in_executor(None, cfg.backend.replace_policy, body)
        except LogUnavailable:
            return _text(503, "event log unavailable; retry later\n")
        if err is not None:
            rejected(request, "policy", "invalid", err.strip())
            return _text(400, err.rstrip("\n") + "\n")
        return web.Response(status=204)

    async def probe(request: web.Request) -> web.Response:
        body = await read_body(request, "probe", MAX_PROBE_BODY)
        if isinstance(body, web.Response):
            return body
        loop = asyncio.get_running_loop()
        status, out = await loop.run_in_executor(None, cfg.backend.probe, body)
        if status == 400:
            rejected(request, "probe", "invalid", out.decode("utf-8", "replace"))
        return web.Response(status=status, body=out, content_type="application/json")

    if cfg.live is not None:
        _live_routes(app, cfg.live, guarded)
    app.router.add_route("*", "/snapshot", guarded("snapshot", ("GET",), snapshot))
    app.router.add_route("*", "/policy", guarded("policy", ("POST", "PUT"), policy))
    app.router.add_route("*", "/probe", guarded("probe", ("POST",), probe))


Guard = Callable[[str, tuple[str, ...], Handler], Handler]


def _live_routes(app: web.Application, live: LiveView, guarded: Guard) -> None:
    """The live page (contract-and-index.md §13.6): the page itself carries no data and is
    open; its data paths follow the admin rule."""
    html = page_html()

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=html, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})  # fmt: skip

    async def state(request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        doc = await loop.run_in_executor(None, live.state)
        return web.json_response(doc, headers={"Cache-Control": "no-store"})

    async def lookup(request: web.Request) -> web.Response:
        body = await read_limited(request, MAX_LOOKUP_BODY)
        if body is None:
            return _text(400, "lookup body too large\n")
        loop = asyncio.get_running_loop()
        try:
            doc = await loop.run_in_executor(None, live.lookup, body)
        except LookupInputError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(doc)

    app.router.add_get("/live", page)
    app.router.add_route("*", "/live/state", guarded("live", ("GET",), state))
    app.router.add_route("*", "/live/lookup", guarded("live", ("POST",), lookup))


def build_apps(cfg: HttpConfig, separate_admin: bool) -> tuple[web.Application, web.Application]:
    """(public app, admin app); they are the same app unless the admin paths have a listener."""
    # client_max_size only bounds request.read(); the admin handlers stream with their own caps.
    guard = guard_middleware(Drops(cfg.metrics.dropped_inputs, log))
    public = web.Application(client_max_size=MAX_POLICY_BODY + 1, middlewares=[guard])
    _public_routes(public, cfg)
    if not separate_admin:
        _admin_routes(public, cfg)
        return public, public
    admin = web.Application(client_max_size=MAX_POLICY_BODY + 1, middlewares=[guard])
    _admin_routes(admin, cfg)
    return public, admin


class HttpServer(LoopThread):
    """Serves the apps on pre-bound sockets from a dedicated thread and event loop."""

    _thread_name = "http"
    _what = "HTTP server"

    def __init__(self, sites: list[tuple[web.Application, socket.socket]]) -> None:
        super().__init__()
        self._sites = sites
        self._runners: list[web.AppRunner] = []

    async def _setup(self) -> None:
        for app, sock in self._sites:  # a distinct app per socket (see build_apps)
            runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=5.0)
            await runner.setup()
            self._runners.append(runner)
            await web.SockSite(runner, sock).start()

    async def _cleanup(self) -> None:
        for runner in self._runners:
            try:
                await runner.cleanup()
            except Exception:
                log.exception("HTTP cleanup failed")
