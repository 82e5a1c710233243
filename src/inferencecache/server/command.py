"""``inferencecache serve``: the hint-plane server (gRPC + HTTP) until SIGTERM/SIGINT.

Start-up problems (unreadable files, a bad policy, a non-loopback listener without an admin
token, a non-loopback gRPC listener without authentication, an address that cannot be bound)
exit 2 with one line on stderr naming the problem.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

import click

from inferencecache import logs
from inferencecache.config import CONTEXT, command_options
from inferencecache.server.settings import ServeSettings

if TYPE_CHECKING:
    from inferencecache.server.auth import Authorizer
    from inferencecache.server.metrics import ServerMetrics
    from inferencecache.server.tls import ReloadingServerCredentials

log = logging.getLogger("inferencecache.server")

GC_THRESHOLD: Final = (10_000, 10, 10)
"""The cyclic GC's first generation runs every 10,000 container allocations instead of 700:
each lookup allocates a few result objects, and the default threshold ran a collection every
~100 lookups (~+1 µs on the mean in process, docs/benchmarks.md); as the subscriber does."""


@click.command("serve", context_settings=CONTEXT)
@command_options(ServeSettings)
def serve(settings: ServeSettings) -> int:
    """Serve the InferenceCache gRPC API, health, reflection and the HTTP surfaces."""
    logs.setup(settings.log_level)
    gc.set_threshold(*GC_THRESHOLD)
    # grpc core logs through absl straight to stderr; keep stderr to our JSON lines unless the
    # operator asked for grpc's own logs.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import prometheus_client

    # No *_created series on /metrics (process-wide switch; this process is the server).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    if settings.workers > 1:
        from inferencecache.server.workers import run_workers

        return int(run_workers(settings))
    return run_server(settings)


def load_security(
    settings: ServeSettings, metrics: ServerMetrics
) -> tuple[str | None, Authorizer, ReloadingServerCredentials | None]:
    """The admin token, the gRPC authorizer and TLS credentials, with the listener rules
    checked; a usage error (exit 2, one line) for any problem. ``serve --workers`` calls it in
    the parent too, so a bad file stops the command instead of every worker."""
    from inferencecache.server.auth import (
        AuthConfigError,
        Authorizer,
        CredentialsFile,
        check_grpc_listener,
        check_listeners,
        read_token_file,
    )
    from inferencecache.server.tls import ReloadingServerCredentials, TlsConfigError, TlsFiles

    try:
        token = read_token_file(settings.admin_token_file) if settings.admin_token_file else None
        check_listeners(token, settings.listeners)
        check_grpc_listener(
            settings.grpc_address,
            authenticated=bool(settings.credentials_file or settings.tls_client_ca_file),
            insecure_disable_auth=settings.insecure_disable_auth,
        )
        creds = (
            CredentialsFile(settings.credentials_file, metrics.config_reloads)
            if settings.credentials_file
            else None
        )
        tls = (
            ReloadingServerCredentials(
                TlsFiles(settings.tls_cert_file, settings.tls_key_file,
                         settings.tls_client_ca_file),
                metrics.config_reloads,
            )
            if settings.tls_cert_file
            else None
        )  # fmt: skip
    except (AuthConfigError, TlsConfigError) as e:
        raise click.UsageError(str(e)) from e
    grpc_auth = Authorizer(creds, mtls=tls is not None and tls.files.mtls,
                           outcomes=metrics.grpc_auth)  # fmt: skip
    return token, grpc_auth, tls


def run_server(
    settings: ServeSettings,
    *,
    worker: int | None = None,
    on_started: Callable[[int], None] | None = None,
) -> int:
    """One server process (``worker``: its index under ``serve --workers N``; ``on_started``
    gets the bound HTTP port once serving)."""
    from inferencecache.config.reloading import ReloadingFile
    from inferencecache.index.pd_topology import PDTopology, TopologyError, load_topology_file
    from inferencecache.index.tenant_config import IndexConfig, PolicyError, load_policy_file
    from inferencecache.server.app import Listeners, Server
    from inferencecache.server.auth import BearerAuth
    from inferencecache.server.backend import IndexBackend, index_settings
    from inferencecache.server.metrics import ServerMetrics
    from inferencecache.server.pd_route import PDRoutes
    from inferencecache.server.render_template import Templates
    from inferencecache.server.streams import StreamSettings
    from inferencecache.templates.registry import TemplateDirError, TemplateRegistry
    from inferencecache.tokenize import TokenizerLoadError, TokenizerSet, load_tokenizer_dir
    from inferencecache.web import ListenError

    metrics = ServerMetrics()
    token, grpc_auth, tls = load_security(settings, metrics)

    tokenizers: TokenizerSet | None = None
    if settings.tokenizer_dir:
        try:
            tokenizers = load_tokenizer_dir(settings.tokenizer_dir)
        except TokenizerLoadError as e:
            raise click.UsageError(f"--tokenizer-dir: {e}") from e
        log.info("tokenizers loaded", extra={"models": tokenizers.model_ids})

    config = IndexConfig()
    if settings.policy_file:
        try:
            config = load_policy_file(settings.policy_file)
        except PolicyError as e:
            raise click.UsageError(f"--policy-file: {e}") from e

    topologies: ReloadingFile[dict[str, PDTopology]] | None = None
    if settings.pd_topology_file:
        try:
            topologies = ReloadingFile(
                settings.pd_topology_file,
                load_topology_file,
                kind="pd_topology",
                reloads=metrics.config_reloads,
            )
        except TopologyError as e:
            raise click.UsageError(f"--pd-topology-file: {e}") from e
    registry: TemplateRegistry | None = None
    if settings.template_dir:
        try:
            registry = TemplateRegistry(settings.template_dir, reloads=metrics.config_reloads)
        except TemplateDirError as e:
            raise click.UsageError(f"--template-dir: {e}") from e
    backend = IndexBackend(
        index_settings(settings),
        metrics,
        tokenizer=tokenizers,
        config=config,
        store_backend=settings.store_backend,
    )
    index = backend.index
    log_node = None
    if settings.event_log:
        log_node = _log_node(settings, backend, metrics, worker)

    def holds() -> int:
        counts = index.counts()
        return counts["holds"] - counts["reserved_holds"]

    metrics.describe(
        block_size=index.settings.engine_block_size,
        max_holds=index.settings.max_holds,
        holds=holds,
    )
    server = Server(
        backend,
        Listeners(
            settings.grpc_address,
            settings.http_address,
            settings.admin_address,
            settings.lookup_http_address,
        ),
        auth=BearerAuth(token),
        metrics=metrics,
        sweep_interval=backend.index.settings.sweep_interval,
        grpc_workers=settings.grpc_workers,
        log_node=log_node,
        reuse_port=worker is not None,
        streams=StreamSettings(
            max_streams=settings.max_streams,
            max_backlog=settings.stream_max_backlog,
            metrics_interval=settings.stream_metrics_interval,
        ),
        pd=PDRoutes(backend.router, metrics, *([topologies.get] if topologies else [])),
        templates=Templates(
            registry, metrics, block_size=index.settings.engine_block_size, tokenizers=tokenizers
        ),
        grpc_auth=grpc_auth,
        tls=tls,
    )

    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server.start()
        except ListenError as e:
            raise click.UsageError(str(e)) from e
        log.info(
            "serving",
            extra={
                "grpc_address": str(replace(settings.grpc_address, port=server.grpc_port)),
                "http_address": str(replace(settings.http_address, port=server.http_port)),
                "admin_address": (
                    str(replace(settings.admin_address, port=server.admin_port))
                    if settings.admin_address is not None and server.admin_port is not None
                    else None
                ),
                "lookup_http_address": (
                    str(replace(settings.lookup_http_address, port=server.lookup_http_port))
                    if settings.lookup_http_address is not None
                    and server.lookup_http_port is not None
                    else None
                ),
                "admin_auth": token is not None,
                "grpc_auth": grpc_auth.required,
                "grpc_tls": "mtls" if tls is not None and tls.files.mtls else tls is not None,
                "block_size": backend.index.settings.engine_block_size,
                "store_backend": settings.store_backend,
                "policies": len(config.policies),
                "quotas": len(config.quotas),
                "event_log": log_node.log.describe() if log_node is not None else None,
                "worker": worker,
            },
        )
        if on_started is not None:
            on_started(server.http_port)
        while not stop.wait(1.0):
            pass
        log.info("shutting down", extra={"signal": received[0] if received else ""})
        server.stop(settings.shutdown_grace)
        log.info("stopped")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.stop(0)
    return 0


def _log_node(
    settings: ServeSettings, backend: Any, metrics: Any, worker: int | None
) -> Any:
    """The event-log side of this replica (``--event-log``); its metrics on the server's
    registry. Only worker 0 (or the only process) writes snapshots into ``--snapshot-dir``."""
    from inferencecache.eventlog import EventLogConfig, EventLogMetrics, LogNode

    password = None
    if settings.event_log_password_file:
        try:
            with open(settings.event_log_password_file, encoding="utf-8") as f:
                password = f.read().strip()
        except OSError as e:
            raise click.UsageError(
                f"--event-log-password-file {settings.event_log_password_file}: "
                f"{e.strerror or e}"
            ) from e
    config = EventLogConfig(
        settings.event_log,
        password=password,
        key_prefix=settings.event_log_key,
        retention=settings.event_log_retention,
        snapshot_dir=settings.snapshot_dir,
        snapshot_interval=settings.snapshot_interval,
        max_replica_lag=settings.max_replica_lag,
        write_snapshots=worker in (None, 0),
    )
    node = LogNode(backend.index, config, EventLogMetrics(metrics.registry))
    backend.log_node = node
    return node
