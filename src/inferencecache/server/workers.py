"""``serve --workers N``: N server processes on one gRPC port, each a replica of the event log.

Why processes: one process is one GIL, so lookups stop scaling at one core; replicas of the
log are identical, so any worker may answer any lookup. The kernel spreads gRPC connections
over the workers (``SO_REUSEPORT``; the parent holds the port bound, not listening, so it is
taken for the whole life of the command). The parent serves the HTTP surfaces itself:
``/healthz`` (every worker alive), ``/readyz`` (every worker ready), ``/metrics`` (each
worker's page with a ``worker`` label added, plus ``inferencecache_server_workers``), and
forwards the admin paths to worker 0 (which checks the bearer token itself). A worker that
exits is started again (it recovers from the newest snapshot and the log).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import socket
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from inferencecache import logs
from inferencecache.config import HostPort
from inferencecache.server.settings import ServeSettings
from inferencecache.web import ListenError, bind_tcp

log = logging.getLogger("inferencecache.server")

_ADMIN = ("/snapshot", "/policy", "/probe")
_LOOPBACK = "127.0.0.1"


def _worker_main(settings: ServeSettings, index: int, conn: Connection) -> None:
    """Entry point of a worker process (multiprocessing, spawn)."""
    import os

    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    logs.setup(settings.log_level)
    import prometheus_client

    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    from inferencecache.server.command import run_server

    def started(http_port: int) -> None:
        conn.send(http_port)
        conn.close()

    run_server(settings, worker=index, on_started=started)


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: Any = None
        self.http_port = 0
        self.starts = 0


class Workers:
    """Starts, watches and stops the worker processes."""

    def __init__(self, settings: ServeSettings, grpc_port: int) -> None:
        self.base = replace(
            settings,
            grpc_address=replace(settings.grpc_address, port=grpc_port),
            http_address=HostPort(_LOOPBACK, 0),
            admin_address=None,
            workers=1,
        )
        self.ctx = multiprocessing.get_context("spawn")
        self.workers = [_Worker(i) for i in range(settings.workers)]
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def start_one(self, w: _Worker, timeout: float = 120.0) -> None:
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_worker_main, args=(self.base, w.index, child),
                                name=f"serve-worker-{w.index}", daemon=False)
        proc.start()
        child.close()
        port = 0
        if parent.poll(timeout):
            try:
                port = int(parent.recv())
            except (EOFError, OSError):
                port = 0
        parent.close()
        with self._lock:
            w.proc, w.http_port = proc, port
            w.starts += 1
        if port:
            log.info("worker started", extra={"worker": w.index, "pid": proc.pid})
        else:
            log.error("worker did not start", extra={"worker": w.index,
                                                     "exitcode": proc.exitcode})

    def watch(self) -> None:
        """Restart workers that exit (until ``stop``); one second between checks."""
        while not self._stopping.wait(1.0):
            for w in self.workers:
                if w.proc is not None and not w.proc.is_alive() and not self._stopping.is_set():
                    log.warning("worker exited; starting it again",
                                extra={"worker": w.index, "exitcode": w.proc.exitcode})
                    time.sleep(min(5.0, 0.5 * w.starts))
                    self.start_one(w)

    def alive(self) -> bool:
        return all(w.proc is not None and w.proc.is_alive() and w.http_port for w in self.workers)

    def stop(self, grace: float) -> None:
        self._stopping.set()
        for w in self.workers:
            if w.proc is not None and w.proc.is_alive():
                w.proc.terminate()  # SIGTERM: the worker's own graceful stop
        end = time.monotonic() + grace + 5.0
        for w in self.workers:
            if w.proc is not None:
                w.proc.join(max(0.1, end - time.monotonic()))
                if w.proc.is_alive():
                    w.proc.kill()
                    w.proc.join(5.0)


Families = dict[str, tuple[str, str, list[str]]]


def _relabel(text: str, worker: int, into: Families) -> None:
    """Add a worker's exposition to ``into`` (name -> help, type, sample lines) with
    ``worker="i"`` on every sample, so each family is written once for all workers."""
    for fam in text_string_to_metric_families(text):
        entry = into.get(fam.name)
        if entry is None:
            entry = into[fam.name] = (fam.documentation, fam.type, [])
        for s in fam.samples:
            labels = dict(s.labels)
            labels["worker"] = str(worker)
            inner = ",".join(f'{k}="{_esc(v)}"' for k, v in sorted(labels.items()))
            entry[2].append(f"{s.name}{{{inner}}} {_num(s.value)}")


def _merge(pages: list[tuple[int, str]], n_workers: int) -> bytes:
    families: Families = {}
    for worker, text in pages:
        _relabel(text, worker, families)
    lines = [
        "# HELP inferencecache_server_workers Worker processes of serve --workers.",
        "# TYPE inferencecache_server_workers gauge",
        f"inferencecache_server_workers {n_workers}",
    ]
    for name, (doc, typ, samples) in families.items():
        if typ == "counter":  # the parser drops the suffix the exposition carries
            name += "_total"
        lines.append(f"# HELP {name} {_esc(doc)}")
        lines.append(f"# TYPE {name} {typ}")
        lines += samples
    return ("\n".join(lines) + "\n").encode()


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _app(workers: Workers) -> web.Application:
    app = web.Application()
    session: dict[str, aiohttp.ClientSession] = {}

    def client() -> aiohttp.ClientSession:
        if "s" not in session:
            session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return session["s"]

    async def get(w: _Worker, path: str) -> tuple[int, str]:
        try:
            async with client().get(f"http://{_LOOPBACK}:{w.http_port}{path}") as r:
                return r.status, await r.text()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return 0, ""

    async def healthz(request: web.Request) -> web.Response:
        ok = workers.alive()
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "worker down\n")

    async def readyz(request: web.Request) -> web.Response:
        if not workers.alive():
            return web.Response(status=503, text="not ready\n")
        answers = await asyncio.gather(*(get(w, "/readyz") for w in workers.workers))
        ok = all(status == 200 for status, _ in answers)
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "not ready\n")

    async def metrics(request: web.Request) -> web.Response:
        answers = await asyncio.gather(*(get(w, "/metrics") for w in workers.workers))
        pages = [(w.index, text) for w, (status, text) in zip(workers.workers, answers,
                                                              strict=True) if status == 200]
        body = await asyncio.get_running_loop().run_in_executor(
            None, _merge, pages, len(workers.workers))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def admin(request: web.Request) -> web.StreamResponse:
        w = workers.workers[0]
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type")}  # fmt: skip
        body = await request.read()
        try:
            async with client().request(request.method, f"http://{_LOOPBACK}:{w.http_port}"
                                        f"{request.path}", headers=headers, data=body) as r:
                payload = await r.read()
                keep = {k: v for k, v in r.headers.items()
                        if k.lower() in ("content-type", "www-authenticate", "allow")}
                return web.Response(status=r.status, body=payload, headers=keep)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return web.Response(status=503, text="worker unavailable\n")

    async def close(app: web.Application) -> None:
        if "s" in session:
            await session["s"].close()

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    for path in _ADMIN:
        app.router.add_route("*", path, admin)
    app.on_cleanup.append(close)
    return app


def _reserve_port(addr: HostPort) -> socket.socket:
    """Bind (not listen) the gRPC address with SO_REUSEPORT: resolves port 0 and keeps the port
    taken while the workers bind their listeners to it."""
    host = addr.host or "::"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, addr.port))
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on --grpc-address {addr}: {e.strerror or e}") from e
    return sock


def run_workers(settings: ServeSettings) -> int:
    import click

    from inferencecache.server.command import load_security
    from inferencecache.server.http import HttpServer
    from inferencecache.server.metrics import ServerMetrics

    load_security(settings, ServerMetrics())  # a bad credential or TLS file: exit 2 here
    try:
        grpc_sock = _reserve_port(settings.grpc_address)
        http_sock = bind_tcp("--http-address", settings.http_address)
    except ListenError as e:
        raise click.UsageError(str(e)) from e
    port = grpc_sock.getsockname()[1]
    workers = Workers(settings, port)
    http = HttpServer([(_app(workers), http_sock)])
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for w in workers.workers:
            workers.start_one(w)
        http.start()
        watcher = threading.Thread(target=workers.watch, name="workers", daemon=True)
        watcher.start()
        log.info("serving with workers", extra={
            "workers": settings.workers, "grpc_port": port,
            "http_port": http_sock.getsockname()[1]})
        while not stop.wait(1.0):
            pass
        log.info("shutting down workers")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        workers.stop(settings.shutdown_grace)
        http.stop(5.0)
        grpc_sock.close()
    return 0
