"""An in-process server on loopback with OS-chosen ports, for tests of any part.

``with running_server() as srv:`` gives a real gRPC server and real HTTP listeners on
127.0.0.1 (ports picked by the OS), backed by a real ``Index``; ``srv.stub()`` is a generated
client stub on a fresh channel. Everything is stopped on exit, also when the test fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from inferencecache.config import HostPort
from inferencecache.index.clock import Clock
from inferencecache.index.lookup_route import PromptTokenizer
from inferencecache.index.pd_topology import Topologies
from inferencecache.index.settings import IndexSettings
from inferencecache.index.tenant_config import IndexConfig
from inferencecache.server.app import Listeners, Server
from inferencecache.server.auth import Authorizer, BearerAuth, CredentialsFile
from inferencecache.server.backend import IndexBackend
from inferencecache.server.metrics import ServerMetrics
from inferencecache.server.pd_route import PDRoutes
from inferencecache.server.render_template import Templates, TextTokenizers
from inferencecache.server.streams import StreamSettings
from inferencecache.server.tls import ReloadingServerCredentials, TlsFiles
from inferencecache.templates import TemplateRegistry
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

LOOPBACK = "127.0.0.1"


@dataclass
class RunningServer:
    server: Server
    backend: IndexBackend
    metrics: ServerMetrics
    channels: list[grpc.Channel] = field(default_factory=list)

    @property
    def grpc_target(self) -> str:
        return f"{LOOPBACK}:{self.server.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.server.http_port}"

    @property
    def lookup_url(self) -> str:
        """Base URL of the HTTP lookup listener (``running_server(lookup_http=True)``)."""
        assert self.server.lookup_http_port is not None, "started without lookup_http=True"
        return f"http://{LOOPBACK}:{self.server.lookup_http_port}"

    @property
    def admin_url(self) -> str:
        port = self.server.admin_port or self.server.http_port
        return f"http://{LOOPBACK}:{port}"

    def channel(self) -> grpc.Channel:
        ch = grpc.insecure_channel(self.grpc_target)
        self.channels.append(ch)
        return ch

    def stub(self) -> pb_grpc.InferenceCacheStub:
        return pb_grpc.InferenceCacheStub(self.channel())  # type: ignore[no-untyped-call]


@contextmanager
def running_server(
    *,
    settings: IndexSettings | None = None,
    clock: Clock | None = None,
    tokenizer: PromptTokenizer | None = None,
    config: IndexConfig | None = None,
    admin_token: str | None = None,
    separate_admin: bool = False,
    start_sweeper: bool = True,
    sweep_interval: float | None = None,
    grpc_workers: int = 32,
    lookup_http: bool = False,
    streams: StreamSettings | None = None,
    pd_topologies: Topologies | Callable[[], Topologies] | None = None,
    template_dir: str | Path | None = None,
    text_tokenizers: TextTokenizers | None = None,
    credentials_file: str | None = None,
    tls: TlsFiles | None = None,
) -> Iterator[RunningServer]:
    """``credentials_file`` / ``tls``: as ``serve --credentials-file`` and ``--tls-*-file``
    (default: no authentication, plaintext)."""
    metrics = ServerMetrics()
    backend = IndexBackend(
        settings or IndexSettings(), metrics, clock=clock, tokenizer=tokenizer, config=config
    )
    listeners = Listeners(
        grpc=HostPort(LOOPBACK, 0),
        http=HostPort(LOOPBACK, 0),
        admin=HostPort(LOOPBACK, 0) if separate_admin else None,
        lookup_http=HostPort(LOOPBACK, 0) if lookup_http else None,
    )
    server = Server(
        backend,
        listeners,
        auth=BearerAuth(admin_token),
        metrics=metrics,
        sweep_interval=(
            sweep_interval if sweep_interval is not None else backend.index.settings.sweep_interval
        ),
        grpc_workers=grpc_workers,
        grpc_auth=Authorizer(
            CredentialsFile(credentials_file, metrics.config_reloads) if credentials_file else None,
            mtls=tls is not None and tls.mtls,
            outcomes=metrics.grpc_auth,
        ),
        tls=ReloadingServerCredentials(tls, metrics.config_reloads) if tls is not None else None,
        streams=streams,
        pd=PDRoutes(
            backend.router,
            metrics,
            pd_topologies if callable(pd_topologies) else lambda: pd_topologies or {},
        ),
        templates=Templates(
            TemplateRegistry(template_dir, reloads=metrics.config_reloads, every=0.0)
            if template_dir is not None
            else None,
            metrics,
            block_size=backend.index.settings.engine_block_size,
            tokenizers=text_tokenizers,
        ),
    )
    running = RunningServer(server, backend, metrics)
    try:
        server.start(start_sweeper=start_sweeper)
        yield running
    finally:
        for ch in running.channels:
            ch.close()
        server.stop(0)
