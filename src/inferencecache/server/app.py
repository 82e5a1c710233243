"""One running server: gRPC (sync grpcio, thread pool), HTTP (aiohttp thread), the optional HTTP
lookup listener (aiohttp on uvloop, its own thread), TTL sweeper.

Why the sync server: at concurrency 1 it measured lower latency than ``grpc.aio`` on this 2-core
machine, and the LookupRoute targets sit near the transport floor (a trivial unary round trip is
~400 µs p50 here with h2load; docs/architecture.md). The index is thread-safe (its own lock),
so gRPC workers, the HTTP thread and the sweeper call it directly.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inferencecache.config import HostPort
from inferencecache.eventlog import LogNode
from inferencecache.index.changes import Observer
from inferencecache.index.facade import Index
from inferencecache.metrics import LazyChildren
from inferencecache.server.auth import Authorizer, BearerAuth
from inferencecache.server.http import AdminBackend, HttpConfig, HttpServer, build_apps
from inferencecache.server.live import LiveView
from inferencecache.server.lookup_http import LookupHttpServer
from inferencecache.server.lookup_path import LookupPath
from inferencecache.server.metrics import ServerMetrics
from inferencecache.server.pd_route import PDRoutes
from inferencecache.server.render_template import Templates
from inferencecache.server.service import SERVICE_NAME, InferenceCacheService, ServiceBackend
from inferencecache.server.settings import MAX_RECEIVE_MESSAGE_BYTES, MAX_SEND_MESSAGE_BYTES
from inferencecache.server.sink import IngestSink, LogSink
from inferencecache.server.streams import Streams, StreamSettings
from inferencecache.server.tls import ReloadingServerCredentials
from inferencecache.web import ListenError, bind_tcp

log = logging.getLogger("inferencecache.server")

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class Backend(ServiceBackend, AdminBackend, Protocol):
    def sweep(self) -> None: ...

    def observe(self, max_backlog: int) -> Observer: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Listeners:
    grpc: HostPort
    http: HostPort
    admin: HostPort | None = None
    lookup_http: HostPort | None = None


def _grpc_target(addr: HostPort) -> str:
    return f"[::]:{addr.port}" if addr.host == "" else str(addr)


class Server:
    """Owns the listeners and threads of one ``serve`` process (or one in-process test server)."""

    def __init__(
        self,
        backend: Backend,
        listeners: Listeners,
        *,
        auth: BearerAuth,
        metrics: ServerMetrics,
        sweep_interval: float,
        grpc_workers: int = 256,
        grpc_auth: Authorizer | None = None,
        tls: ReloadingServerCredentials | None = None,
        log_node: LogNode | None = None,
        reuse_port: bool = False,
        streams: StreamSettings | None = None,
        pd: PDRoutes | None = None,
        templates: Templates | None = None,
    ) -> None:
        self.backend = backend
        self.log_node = log_node
        # with the event log, ingest is appended and the follower applies it (server/sink.py)
        self.sink: IngestSink | None = LogSink(log_node) if log_node is not None else None
        self.reuse_port = reuse_port
        self.pd = pd
        self.templates = templates
        self.listeners = listeners
        self.metrics = metrics
        self.auth = auth
        self.sweep_interval = sweep_interval
        self.grpc_workers = grpc_workers
        self.health = health.HealthServicer()
        self.grpc_port = 0
        self.http_port = 0
        self.admin_port: int | None = None
        self.lookup_http_port: int | None = None
        self.grpc_auth = grpc_auth if grpc_auth is not None else Authorizer()
        self.tls = tls
        self.lookup = LookupPath(backend, metrics, self.grpc_auth)
        ss = streams if streams is not None else StreamSettings()
        # streams hold a worker each: never more than half the pool (server/streams.py)
        ss = replace(ss, max_streams=max(1, min(ss.max_streams, grpc_workers // 2)))
        self.streams = Streams(backend.observe, metrics.registry, ss)
        index = getattr(backend, "index", None)
        # /live/lookup is an admin path (the admin token's rule): its lookups skip the gRPC
        # credentials check
        live_lookup = LookupPath(backend, metrics) if self.grpc_auth.required else self.lookup
        self.live = LiveView(index, live_lookup) if isinstance(index, Index) else None
        self._grpc: grpc.Server | None = None
        self._http: HttpServer | None = None
        self._lookup_http: LookupHttpServer | None = None
        self._sweeper: threading.Thread | None = None
        self._stop_sweeper = threading.Event()
        self._ready = threading.Event()
        self._stopped = threading.Event()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, *, start_sweeper: bool = True) -> None:
        """Bind every listener (``ListenError`` on failure), then start serving.

        ``/readyz`` turns 200 once the sweeper runs; tests pass ``start_sweeper=False`` to see
        the not-ready state and call ``start_sweeper()`` later. With the event log the replica
        first loads its newest snapshot, and ``/readyz`` also waits until it has caught up.
        """
        if self.log_node is not None:
            self.log_node.start()
        http_sock = bind_tcp("--http-address", self.listeners.http)
        admin_sock = lookup_sock = None
        try:
            if self.listeners.admin is not None:
                admin_sock = bind_tcp("--admin-address", self.listeners.admin)
            if self.listeners.lookup_http is not None:
                lookup_sock = bind_tcp("--lookup-http-address", self.listeners.lookup_http)
            self._start_grpc()
        except BaseException:
            for sock in (http_sock, admin_sock, lookup_sock):
                if sock is not None:
                    sock.close()
            raise
        self.http_port = http_sock.getsockname()[1]
        self.admin_port = admin_sock.getsockname()[1] if admin_sock is not None else None
        if lookup_sock is not None:
            self.lookup_http_port = lookup_sock.getsockname()[1]
            self._lookup_http = LookupHttpServer(lookup_sock, self.lookup)
        cfg = HttpConfig(
            registry=self.metrics.registry,
            metrics=self.metrics,
            auth=self.auth,
            backend=self.backend,
            ready=self._is_ready,
            health=self.health_problem,
            live=self.live,
        )
        public, admin = build_apps(cfg, separate_admin=admin_sock is not None)
        sites = [(public, http_sock)]
        if admin_sock is not None:
            sites.append((admin, admin_sock))
        self._http = HttpServer(sites)
        try:
            self._http.start()
            if self._lookup_http is not None:
                self._lookup_http.start()
        except BaseException:
            if self._grpc is not None:
                self._grpc.stop(0)
            self._http.stop(5.0)
            for sock in (http_sock, admin_sock, lookup_sock):
                if sock is not None:
                    sock.close()
            raise
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.metrics.server_up.set(1)
        tls_state = 0 if self.tls is None else 2 if self.tls.files.mtls else 1
        self.metrics.grpc_tls_enabled.set(tls_state)
        if start_sweeper:
            self.start_sweeper()

    def _is_ready(self) -> bool:
        return self._ready.is_set() and (self.log_node is None or self.log_node.ready)

    def start_sweeper(self) -> None:
        if self._sweeper is not None or self._stopped.is_set():
            return
        if self.log_node is not None:  # the log drives the sweeps (eventlog.applier)
            self._ready.set()
            return
        self._sweeper = threading.Thread(target=self._sweep_loop, name="sweeper", daemon=True)
        self._sweeper.start()

    def _start_grpc(self) -> None:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.grpc_workers, thread_name_prefix="grpc"),
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
                # a second server on the same port must fail to bind, except the workers of
                # `serve --workers N`, which share it on purpose
                ("grpc.so_reuseport", 1 if self.reuse_port else 0),
            ],
        )
        service = InferenceCacheService(
            self.backend, self.metrics, self.lookup, self.sink, streams=self.streams, pd=self.pd,
            templates=self.templates, auth=self.grpc_auth,
        )  # fmt: skip
        handlers = service.handlers()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        server.add_registered_method_handlers(SERVICE_NAME, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        # Every other health service name answers NOT_FOUND (HealthServicer's default).
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.listeners.grpc.port != 0 and not self.reuse_port:
            # Probe the address with a plain socket first: a precise one-line error (errno)
            # instead of grpc core's log line plus a generic RuntimeError.
            bind_tcp("--grpc-address", self.listeners.grpc).close()
        try:
            target = _grpc_target(self.listeners.grpc)
            if self.tls is not None:
                port = server.add_secure_port(target, self.tls.credentials())
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as e:
            raise ListenError(
                f"cannot listen on --grpc-address {self.listeners.grpc}: address in use or "
                "not available"
            ) from e
        if port == 0:
            raise ListenError(f"cannot listen on --grpc-address {self.listeners.grpc}")
        server.start()
        self.grpc_port = port
        self._grpc = server

    def _sweep_loop(self) -> None:
        self._ready.set()  # ready once the sweeper has started (contract-and-index.md §6.2)
        sweeps = LazyChildren(self.metrics.sweeps)
        while not self._stop_sweeper.wait(self.sweep_interval):
            if self.live is not None:
                self.live.expire_if_idle()
            try:
                self.backend.sweep()
                sweeps("ok").inc()
            except Exception:
                sweeps("error").inc()
                log.exception("TTL sweep failed; retrying next interval")

    @property
    def ready(self) -> bool:
        return self._is_ready()

    def health_problem(self) -> str | None:
        """``None`` while serving normally, else why ``/healthz`` answers 503: the sweeper
        thread ended (it catches every exception of a sweep, so only a fatal error ends it)."""
        sweeper = self._sweeper
        if sweeper is not None and not sweeper.is_alive() and not self._stopped.is_set():
            return "degraded: the TTL sweeper thread ended"
        node = self.log_node
        if node is not None and self._ready.is_set() and not node.follower.alive \
                and not self._stopped.is_set():
            return "degraded: the event-log follower thread ended"
        return None

    def stop(self, grace: float = 10.0) -> None:
        """Graceful: health NOT_SERVING, stop accepting, let in-flight RPCs finish (≤ grace)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.metrics.server_up.set(0)
        self._ready.clear()
        if self._lookup_http is not None:
            self._lookup_http.stop(grace + 5.0)
        if self.live is not None:
            self.live.close()
        self.streams.close()  # open streams end (OK) instead of holding the grace period
        if self._grpc is not None:
            self._grpc.stop(grace).wait(grace + 5.0)
        self._stop_sweeper.set()
        if self._sweeper is not None:
            self._sweeper.join(5.0)
        if self._http is not None:
            self._http.stop(grace + 5.0)
        if self.log_node is not None:
            self.log_node.stop()
        self.backend.close()
