"""The server's Prometheus metrics (contract-and-index.md §9.1) in a dedicated registry.

Label children on the lookup path are bound once per (model, reason, hint_used) and cached:
``labels()`` costs ~2.7 µs a call, a cached child's ``inc()`` a fraction of that. Model ids come
from clients, so the number of distinct ``model`` label values is bounded (``MAX_MODEL_LABELS``);
later models share the label value ``OVERFLOW_MODEL`` instead of growing memory without end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inferencecache.metrics import FallbackCollector, LazyChildren, publish_info
from inferencecache.supervise import drop_counter

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
MAX_MODEL_LABELS = 1024
OVERFLOW_MODEL = "__other__"
AUTH_ENDPOINTS = ("snapshot", "policy", "probe", "live")


class ServerMetrics:
    """Every server-side metric, registered in ``self.registry`` (never the global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.server_up = Gauge("inferencecache_server_up", "1 while serving, 0 after.", registry=r)
        self.grpc_tls_enabled = Gauge(
            "inferencecache_server_grpc_tls_enabled",
            "1 if the gRPC listener serves TLS (2: TLS with client certificates), 0 if plaintext.",
            registry=r,
        )
        self.grpc_auth = Counter(
            "inferencecache_server_grpc_auth",
            "Authorization decisions on gRPC methods and the HTTP lookup listener, by method "
            "and outcome (ok, unauthenticated, permission_denied).",
            ["method", "outcome"],
            registry=r,
        )
        self.index_entries = Gauge(
            "inferencecache_index_entries",
            "Distinct index keys per model (probe tenant excluded).",
            ["model"],
            registry=r,
        )
        self.lookup_calls = Counter(
            "inferencecache_lookup_route_calls",
            "LookupRoute calls by model, reason code and whether a hint was returned.",
            ["model", "reason_code", "hint_used"],
            registry=r,
        )
        self.lookup_latency = Histogram(
            "inferencecache_lookup_route_latency_seconds",
            "LookupRoute handling latency.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_evictions = Counter(
            "inferencecache_tenant_evictions",
            "Keys removed by tenant quotas.",
            ["tenant_id", "reason"],
            registry=r,
        )
        self.index_evictions = Counter(
            "inferencecache_index_evictions",
            "Holds removed by the global cap or the TTL sweep.",
            ["algorithm", "reason"],
            registry=r,
        )
        self.ingest_dropped = Counter(
            "inferencecache_ingest_dropped",
            "Prefix entries dropped at ingest.",
            ["reason"],
            registry=r,
        )
        self.auth = {
            ep: Counter(
                f"inferencecache_{ep}_auth",
                f"Requests reaching /{ep} authentication, by result.",
                ["result"],
                registry=r,
            )
            for ep in AUTH_ENDPOINTS
        }
        r.register(FallbackCollector("inferencecache_native_fallbacks"))
        self.undecodable = Counter(
            "inferencecache_server_undecodable_requests",
            "gRPC requests protobuf could not decode, by method (answered fail-open).",
            ["method"],
            registry=r,
        )
        self.admin_rejected = Counter(
            "inferencecache_server_admin_rejected_requests",
            "Authorized /policy and /probe requests answered 400, by endpoint and reason.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.lookup_errors = Counter(
            "inferencecache_server_lookup_errors",
            "LookupRoute calls that raised inside the server (answered NO_HINT).",
            registry=r,
        )
        self.ingest_errors = Counter(
            "inferencecache_server_ingest_errors",
            "Updates/events skipped because applying them raised (a bug; logged).",
            ["kind"],
            registry=r,
        )
        self.stream_errors = Counter(
            "inferencecache_server_report_stream_errors",
            "ReportCacheState streams that ended with an error (cancel, undecodable message).",
            ["reason"],
            registry=r,
        )
        self.ingest_messages = Counter(
            "inferencecache_server_ingest_messages",
            "CacheStateUpdate messages and CacheEvents applied.",
            ["kind"],
            registry=r,
        )
        # requests whose handling raised unexpectedly, by gRPC method (or "http") and reason
        self.dropped_inputs = drop_counter("inferencecache_server_", r)
        self.config_reloads = Counter(
            "inferencecache_server_config_reloads",
            "Re-reads of a changed --pd-topology-file, --template-dir, --credentials-file or TLS "
            "file, by file kind and result (error: the last good version stays in use).",
            ["file", "result"],
            registry=r,
        )
        self.pd_route_calls = Counter(
            "inferencecache_pd_route_calls",
            "LookupPDRoute calls by reason_code.",
            ["reason_code"],
            registry=r,
        )
        self.render_template_calls = Counter(
            "inferencecache_render_template_calls",
            "RenderTemplate calls by reason_code.",
            ["reason_code"],
            registry=r,
        )
        self.sweeps = Counter(
            "inferencecache_server_sweeps", "TTL sweeps run (and failed).", ["result"], registry=r
        )
        self._lock = threading.Lock()
        self._calls = LazyChildren(self.lookup_calls)
        self._latency = LazyChildren(self.lookup_latency)
        self._models: set[str] = set()

    def _model_label(self, model: str) -> str:
        if model in self._models:
            return model
        with self._lock:
            if model in self._models:
                return model
            if len(self._models) >= MAX_MODEL_LABELS:
                return OVERFLOW_MODEL
            self._models.add(model)
            return model

    def describe(self, *, block_size: int, max_holds: int, holds: Callable[[], int]) -> None:
        """The ``serve`` process's identity and cap: ``inferencecache_server_info{version,
        block_size}`` (compared by ``doctor``), ``inferencecache_index_holds`` (read at scrape
        time) and ``inferencecache_index_max_holds`` (the "index near its cap" alert)."""
        r = self.registry
        publish_info(r, "inferencecache_server", "Version and block size (value 1).",
                     {"block_size": block_size})
        Gauge(
            "inferencecache_index_holds",
            "Holds counted against --max-holds (probe tenant excluded).",
            registry=r,
        ).set_function(holds)
        Gauge(
            "inferencecache_index_max_holds", "The global hold cap (0 = unbounded).", registry=r
        ).set(max_holds)

    def observe_lookup(self, model: str, reason: str, hint_used: bool, seconds: float) -> None:
        """Exactly one counter increment and one latency observation per LookupRoute call."""
        label = model if model in self._models else self._model_label(model)
        self._calls(label, reason, "true" if hint_used else "false").inc()
        self._latency(label).observe(seconds)


class PrometheusIndexMetrics:
    """The index's ``IndexMetrics`` sink bound to the server registry (children cached)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._evictions = LazyChildren(metrics.index_evictions)
        self._tenant = LazyChildren(metrics.tenant_evictions)
        self._dropped = LazyChildren(metrics.ingest_dropped)
        self._entries = LazyChildren(metrics.index_entries)

    def index_evictions(self, algorithm: str, reason: str, n: int) -> None:
        self._evictions(algorithm, reason).inc(n)

    def tenant_evictions(self, tenant_id: str, reason: str, n: int) -> None:
        self._tenant(tenant_id, reason).inc(n)

    def ingest_dropped(self, reason: str, n: int) -> None:
        self._dropped(reason).inc(n)

    def index_entries(self, model: str, n: int) -> None:
        self._entries(model).set(n)
