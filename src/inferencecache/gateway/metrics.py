"""The gateway's Prometheus metrics, in a dedicated registry (prefix ``inferencecache_gateway_``).

Every label value comes from a bounded set: replica ids are the configured ones (plus ``none``),
reasons are ``routing.reasons.ALL``, causes and kinds are fixed strings here, status is the HTTP
status code. Children are bound lazily and cached (``labels()`` costs microseconds).
"""

from __future__ import annotations

import logging
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inferencecache.metrics import LazyChildren
from inferencecache.supervise import Drops, LoopSupervisor, drop_counter

PREFIX: Final = "inferencecache_gateway_"

HINT_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)
OVERHEAD_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)

# fallbacks_total{cause} (gateway/app.py maps reason codes to causes):
#   no_hint             the server answered NO_HINT / TIMEOUT / POLICY_REQUIRES_CHAIN
#   unknown             UNKNOWN_TENANT / UNKNOWN_MODEL / UNKNOWN_HASH_SCHEME (config mismatch)
#   timeout             our LookupRoute deadline passed
#   server_error        the RPC failed (server down, ...)
#   replica_unhealthy   the hinted replicas are all down or not configured here
#   no_chain            no fingerprint: no tokenizer, prompt shorter than a block, unsupported parts
#   unrecognized        a reason code this version does not know
#   oracle_unavailable  the oracle policy could not read any engine


class GatewayMetrics:
    """Every gateway metric, registered in ``self.registry`` (never the global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = LazyChildren(
            Counter(
                "inferencecache_gateway_requests",
                "Proxied requests by endpoint, engine replica, route reason and HTTP status.",
                ["endpoint", "replica", "reason", "status"],
                registry=r,
            )
        )
        self.hint_latency = Histogram(
            "inferencecache_gateway_hint_latency_seconds",
            "LookupRoute round trip seen by the gateway (successful calls).",
            buckets=HINT_BUCKETS,
            registry=r,
        )
        self.hints = LazyChildren(
            Counter(
                "inferencecache_gateway_hints",
                "LookupRoute outcomes by reason code (gateway-side codes for failures).",
                ["reason_code"],
                registry=r,
            )
        )
        self.fallbacks = LazyChildren(
            Counter(
                "inferencecache_gateway_fallbacks",
                "Requests the policy routed by its round-robin fallback, by cause.",
                ["cause"],
                registry=r,
            )
        )
        self.pd_requests = LazyChildren(
            Counter(
                "inferencecache_gateway_pd_requests",
                "P/D mode requests by outcome: pd (prefilled and decoded on the pair), or why "
                "they went to one engine (no_pair, unhealthy, prefill_<failure>, decode_failed).",
                ["outcome"],
                registry=r,
            )
        )
        self.upstream_errors = LazyChildren(
            Counter(
                "inferencecache_gateway_upstream_errors",
                "Engine failures by replica and kind (connect, timeout, disconnect, status_5xx, "
                "stream_broken, health, oracle).",
                ["replica", "kind"],
                registry=r,
            )
        )
        self.bad_requests = LazyChildren(
            Counter(
                "inferencecache_gateway_bad_requests",
                "Requests answered with an error by the gateway itself, by error code.",
                ["code"],
                registry=r,
            )
        )
        self.overhead = Histogram(
            "inferencecache_gateway_overhead_seconds",
            "Time from a request's arrival to its dispatch (tokenize, hint, choose).",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.tokenize = Histogram(
            "inferencecache_gateway_tokenize_seconds",
            "Prompt tokenization and fingerprinting time.",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.engine_up = LazyChildren(
            Gauge(
                "inferencecache_gateway_engine_up",
                "1 while the engine is considered healthy, 0 while it is skipped.",
                ["replica"],
                registry=r,
            )
        )
        # requests and probe answers whose handling raised unexpectedly: {loop, reason}
        log = logging.getLogger("inferencecache.gateway")
        self.drops = Drops(drop_counter(PREFIX, r), log)
        # the engine health watchers, restarted if one dies: loop_restarts, loop_up
        self.loops = LoopSupervisor(PREFIX, r, log)
        self.in_flight = LazyChildren(
            Gauge(
                "inferencecache_gateway_in_flight",
                "Requests currently proxied to each engine.",
                ["replica"],
                registry=r,
            )
        )
