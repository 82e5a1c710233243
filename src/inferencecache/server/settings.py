"""``inferencecache serve`` settings: one flag per field, each also ``INFERENCECACHE_<FLAG>``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

from inferencecache.config import (
    DURATION,
    HOST_PORT,
    HostPort,
    log_level_setting,
    parse_host_port,
    setting,
)
from inferencecache.eventlog.redislog import check_url
from inferencecache.index.backends import STORE_BACKENDS

DEFAULT_GRPC_ADDRESS = HostPort("127.0.0.1", 9090)
DEFAULT_HTTP_ADDRESS = HostPort("127.0.0.1", 8080)

MAX_RECEIVE_MESSAGE_BYTES = 16 * 1024 * 1024
"""gRPC receive bound: 1,048,576 token ids as 5-byte varints (5 MiB) or a 16-byte-hash chain of
~600k blocks still fit; anything larger is refused by gRPC with RESOURCE_EXHAUSTED."""

MAX_SEND_MESSAGE_BYTES = 16 * 1024 * 1024
"""A LookupRoute echo of 1,048,576 token ids is at most 5 MiB."""


class _OptionalHostPort(click.ParamType):  # type: ignore[type-arg]
    """``host:port``, or empty for "not configured"."""

    name = "host:port"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None or isinstance(value, HostPort):
            return value
        if str(value).strip() == "":
            return None
        try:
            return parse_host_port(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


OPTIONAL_HOST_PORT = _OptionalHostPort()


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``serve`` reads from flags and the environment (docs/server.md has the table)."""

    grpc_address: HostPort = setting(  # noqa: RUF009 (HostPort is frozen)
        DEFAULT_GRPC_ADDRESS,
        param=HOST_PORT,
        help="gRPC listen address (InferenceCache, health, reflection).",
    )
    http_address: HostPort = setting(  # noqa: RUF009
        DEFAULT_HTTP_ADDRESS,
        param=HOST_PORT,
        help="HTTP listen address (/healthz, /readyz, /metrics and, unless --admin-address is "
        "set, /snapshot, /policy, /probe).",
    )
    admin_address: HostPort | None = setting(  # noqa: RUF009
        None,
        param=OPTIONAL_HOST_PORT,
        help="Optional separate listener for the admin paths /snapshot, /policy and /probe.",
    )
    lookup_http_address: HostPort | None = setting(  # noqa: RUF009
        None,
        param=OPTIONAL_HOST_PORT,
        help="Optional HTTP/1.1 lookup listener: POST /v1/lookup (LookupRouteRequest as JSON "
        "or protobuf, the same answers as the gRPC method, a fraction of its cost) and "
        "Dynamo's POST /query. Empty: off.",
    )
    admin_token_file: str = setting(
        "",
        help="File holding the bearer token the admin paths require. Without it they are "
        "open, and serve refuses any non-loopback listener.",
        metavar="PATH",
    )
    credentials_file: str = setting(
        "",
        help="gRPC (and HTTP lookup) credentials: one per line, <name> <roles> <tenants> "
        "<secret>... (docs/security.md); re-read when it changes. Empty: no authentication.",
        metavar="PATH",
    )
    tls_cert_file: str = setting(
        "", help="PEM certificate chain the gRPC listener serves (TLS); re-read when it changes.",
        metavar="PATH",
    )
    tls_key_file: str = setting(
        "", help="PEM private key of --tls-cert-file.", metavar="PATH"
    )
    tls_client_ca_file: str = setting(
        "",
        help="PEM CA bundle for client certificates: set, gRPC clients must present one (mTLS); "
        "a certificate's CN/SAN selects a credential (cert:<name>) of --credentials-file.",
        metavar="PATH",
    )
    insecure_disable_auth: bool = setting(
        False,
        help="Allow a non-loopback gRPC listener without --credentials-file or "
        "--tls-client-ca-file (anyone who reaches it can rewrite routing).",
    )
    tokenizer_dir: str = setting(
        "",
        help="Directory of <model_id>/tokenizer.json (+ tokenizer_config.json) for "
        "LookupRoute.prompt_text; unset: no server-side tokenization.",
        metavar="DIR",
    )
    policy_file: str = setting(
        "", help="Per-tenant policies and quotas (YAML or JSON), read at startup.", metavar="PATH"
    )
    pd_topology_file: str = setting(
        "",
        help="Prefill/decode topologies for LookupPDRoute (YAML or JSON); re-read when the "
        "file changes (an invalid new version keeps the last good one).",
        metavar="PATH",
    )
    template_dir: str = setting(
        "",
        help="Prompt templates for RenderTemplate: <DIR>/<tenant_id>/<name>.j2, each re-read "
        "when it changes; unset: every template is TEMPLATE_NOT_FOUND.",
        metavar="DIR",
    )
    block_size: int = setting(
        16,
        help="Tokens per fingerprint block (ENGINE_BLOCK_SIZE); must equal the engines', "
        "subscribers' and gateways'. <= 0 means the default 16.",
    )
    default_ttl: float = setting(
        1800.0, param=DURATION, help="Hold TTL when a tenant policy sets none (<= 0: 30m)."
    )
    sweep_interval: float = setting(
        60.0, param=DURATION, help="How often the TTL sweeper runs (<= 0: 1m)."
    )
    max_holds: int = setting(
        1_000_000,
        help="Global cap on (key, replica) holds, enforced after each ingest (0 = unbounded).",
    )
    max_tenants: int = setting(
        10_000,
        help="Cap on tenants with state (holds or stats); a new tenant's updates beyond it are "
        "refused and counted (0 = unbounded).",
    )
    max_replicas_per_scope: int = setting(
        4_096,
        help="Cap on replicas per (tenant, model); a new replica's updates beyond it are refused "
        "and counted (0 = unbounded).",
    )
    max_stats_rows: int = setting(
        100_000,
        help="Cap on (tenant, model, replica) stats rows; new rows beyond it are refused and "
        "counted (0 = unbounded).",
    )
    store_backend: str = setting(
        "native" if "native" in STORE_BACKENDS else "python",
        param=click.Choice(sorted(STORE_BACKENDS)),
        help="Where the index keeps its holds: native (compiled, the default when built) or "
        "python (pure Python, slower); index/backends.py lists them.",
    )
    pressure_weight: float = setting(
        1.0, help="PRESSURE_WEIGHT: score factor clamp(1 - w * pressure, 0, 1); 0 turns it off."
    )
    slo_tight_ttft_ms: int = setting(
        200, help="Requests with 0 < slo.ttft_ms < this get the freshness bias (0 = off)."
    )
    slo_tight_bias: float = setting(1.0, help="SLO_TIGHT_BIAS for tight-TTFT requests (0 = off).")
    tenant_hot_min_hit_rate: float = setting(
        0.1, help="Minimum replica hit_rate for a TENANT_HOT candidate (inclusive)."
    )
    tenant_hot_max_age: float = setting(
        300.0, param=DURATION, help="Maximum stats age for TENANT_HOT (0 disables TENANT_HOT)."
    )
    grpc_workers: int = setting(
        256,
        help="gRPC worker threads. Each open ReportCacheState stream holds one for its "
        "lifetime, so keep this above the number of subscribers plus lookup concurrency.",
    )
    max_streams: int = setting(
        32,
        help="Open StreamCacheEvents/StreamMetrics streams allowed at once (each holds a gRPC "
        "worker; clamped to half of --grpc-workers); one more is refused RESOURCE_EXHAUSTED.",
    )
    stream_max_backlog: int = setting(
        100_000,
        help="Index changes a StreamCacheEvents observer may lag behind before it is "
        "disconnected with RESOURCE_EXHAUSTED (it never slows ingest).",
    )
    stream_metrics_interval: float = setting(
        5.0, param=DURATION, help="Period of StreamMetrics samples (the first one is at once)."
    )
    shutdown_grace: float = setting(
        10.0,
        param=DURATION,
        help="On SIGTERM/SIGINT, how long in-flight RPCs may finish before they are cancelled.",
    )
    event_log: str = setting(
        "",
        help="Shared event log: redis://HOST:PORT/DB or rediss://... (Redis >= 7 or Valkey). "
        "Every accepted ingest is appended to it and every replica applies it in order; "
        "unset: the index lives in this process only.",
        metavar="URL",
    )
    event_log_password_file: str = setting(
        "", help="File with the event log's Redis password (overrides the URL's).", metavar="PATH"
    )
    event_log_key: str = setting(
        "inferencecache",
        help="Key prefix of the event log in Redis ({PREFIX}:log, :seq, :policy); one per "
        "shard when several logs share a Redis.",
    )
    event_log_retention: float = setting(
        0.0,
        param=DURATION,
        help="How long entries stay in the log (XTRIM MINID); 0 = the largest hold TTL + 10m.",
    )
    snapshot_dir: str = setting(
        "",
        help="Directory for this replica's index snapshots (with --event-log); start-up loads "
        "the newest valid one and replays the log from there.",
        metavar="DIR",
    )
    snapshot_interval: float = setting(
        300.0, param=DURATION, help="How often a replica writes a snapshot (with --snapshot-dir)."
    )
    max_replica_lag: float = setting(
        2.0,
        param=DURATION,
        help="/readyz is 503 until the replica has caught up to within this of the log head.",
    )
    workers: int = setting(
        1,
        help="Server processes sharing the gRPC port (SO_REUSEPORT), each a replica of the "
        "event log (needs --event-log); the parent serves HTTP and labels each worker's "
        "metrics.",
    )
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        for name in ("max_holds", "max_tenants", "max_replicas_per_scope", "max_stats_rows"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 0 (0 = unbounded), got {getattr(self, name)}")
        if self.event_log:
            try:
                check_url(self.event_log)
            except ValueError as e:
                raise ValueError(f"--event-log {e}") from None
        elif self.workers > 1:
            raise ValueError("--workers above 1 needs --event-log (each worker is a replica)")
        elif self.snapshot_dir:
            raise ValueError("--snapshot-dir needs --event-log")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if not self.event_log_key or any(c in self.event_log_key for c in "{}"):
            raise ValueError("--event-log-key must be non-empty, without { or }")
        if self.event_log_retention < 0:
            raise ValueError("--event-log-retention must be >= 0 (0 = automatic)")
        if self.snapshot_interval <= 0:
            raise ValueError("--snapshot-interval must be > 0")
        if self.max_replica_lag <= 0:
            raise ValueError("--max-replica-lag must be > 0")
        if self.grpc_workers < 1:
            raise ValueError(f"--grpc-workers must be >= 1, got {self.grpc_workers}")
        if self.max_streams < 1:
            raise ValueError(f"--max-streams must be >= 1, got {self.max_streams}")
        if self.stream_max_backlog < 1:
            raise ValueError(f"--stream-max-backlog must be >= 1, got {self.stream_max_backlog}")
        if not self.stream_metrics_interval > 0:
            raise ValueError("--stream-metrics-interval must be > 0")
        if self.shutdown_grace < 0:
            raise ValueError("--shutdown-grace must be >= 0")
        if self.tenant_hot_max_age < 0:
            raise ValueError("--tenant-hot-max-age must be >= 0 (0 disables TENANT_HOT)")
        if self.store_backend not in STORE_BACKENDS:
            raise ValueError(
                f"--store-backend {self.store_backend} is not available in this installation "
                f"(have: {', '.join(sorted(STORE_BACKENDS))})"
            )
        for name in ("pressure_weight", "slo_tight_bias", "tenant_hot_min_hit_rate"):
            value = getattr(self, name)
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number")

    @property
    def listeners(self) -> list[tuple[str, HostPort]]:
        """(flag, address) of every listener that will be opened."""
        out = [("--grpc-address", self.grpc_address), ("--http-address", self.http_address)]
        if self.admin_address is not None:
            out.append(("--admin-address", self.admin_address))
        if self.lookup_http_address is not None:
            out.append(("--lookup-http-address", self.lookup_http_address))
        return out
