"""The server's view of the index: one object the gRPC service and the HTTP admin paths call.

All translation between the contract's wire/JSON shapes and the index's plain types that is not
protobuf-specific lives here (``/snapshot`` JSON, ``/policy`` errors, ``/probe``).
"""

from __future__ import annotations

import dataclasses
import json
import logging

from inferencecache.eventlog import LogNode, LogUnavailable
from inferencecache.eventlog.codec import KIND_POLICY
from inferencecache.index.backends import store_factory
from inferencecache.index.changes import Observer
from inferencecache.index.clock import Clock, SystemClock
from inferencecache.index.facade import Index
from inferencecache.index.lookup_route import PromptTokenizer, Router
from inferencecache.index.model import (
    CacheState,
    EventLike,
    LookupRequest,
    LookupResult,
    PackedUpdate,
    Update,
)
from inferencecache.index.probe import Prober, ProbeRequestError
from inferencecache.index.settings import IndexSettings
from inferencecache.index.tenant_config import IndexConfig, PolicyError, decode_policy_body
from inferencecache.server.metrics import PrometheusIndexMetrics, ServerMetrics
from inferencecache.server.settings import ServeSettings

log = logging.getLogger("inferencecache.server")


_RENAMED = {"engine_block_size": "block_size"}
"""IndexSettings fields whose ``serve`` flag has another name (the flag every part shares)."""


def index_settings(s: ServeSettings) -> IndexSettings:
    """The index knobs of ``serve``'s settings: every ``IndexSettings`` field that ``serve``
    has a flag of the same name for (a new index knob needs no line here)."""
    values = {
        f.name: getattr(s, _RENAMED.get(f.name, f.name))
        for f in dataclasses.fields(IndexSettings)
        if hasattr(s, _RENAMED.get(f.name, f.name))
    }
    return IndexSettings(**values)


class IndexBackend:
    """Implements ``server.app.Backend`` on the real ``Index`` + ``Router``."""

    def __init__(
        self,
        settings: IndexSettings,
        metrics: ServerMetrics,
        *,
        clock: Clock | None = None,
        tokenizer: PromptTokenizer | None = None,
        config: IndexConfig | None = None,
        store_backend: str | None = None,
    ) -> None:
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.index = Index(
            settings,
            clock=self.clock,
            metrics=PrometheusIndexMetrics(metrics),
            config=config,
            store_factory=store_factory(store_backend),
        )
        self.router = Router(self.index, tokenizer=tokenizer)
        self.prober = Prober(self.index)
        self.log_node: LogNode | None = None  # set by `serve --event-log` (policy via the log)

    # -- gRPC -----------------------------------------------------------------------------------

    def monotonic(self) -> float:
        return self.clock.monotonic()

    def apply_update(self, update: Update | PackedUpdate) -> None:
        self.index.apply_update(update)

    def apply_batch(self, batch: bytes) -> None:
        self.index.apply_batch(batch)

    def apply_event(self, event: EventLike) -> None:
        self.index.apply_event(event)

    def lookup(self, request: LookupRequest) -> LookupResult:
        return self.router.lookup(request)

    def cache_state(self, tenant_id: str, model_id: str) -> CacheState:
        return self.index.cache_state(tenant_id, model_id)

    def sweep(self) -> None:
        self.index.sweep()

    def observe(self, max_backlog: int) -> Observer:
        """A change-feed observer (StreamCacheEvents, the live page)."""
        return self.index.observe(max_backlog)

    # -- HTTP admin -------------------------------------------------------------------------------

    def snapshot_json(self) -> bytes:
        return json.dumps(self.index.snapshot(), separators=(",", ":")).encode()

    def replace_policy(self, body: bytes) -> str | None:
        try:
            config = decode_policy_body(body)
        except PolicyError as e:
            return str(e)
        if self.log_node is not None:
            # every replica replaces it when it applies the entry (LogUnavailable: 503)
            fut = self.log_node.submit(KIND_POLICY, body)
            try:
                fut.result(10.0)
            except LogUnavailable:
                raise
            except Exception as e:
                raise LogUnavailable("event log did not answer in time") from e
            log.info("policy appended to the event log",
                     extra={"policies": len(config.policies), "quotas": len(config.quotas)})
            return None
        self.index.replace_config(config)
        log.info(
            "policy replaced",
            extra={"policies": len(config.policies), "quotas": len(config.quotas)},
        )
        return None

    def probe(self, body: bytes) -> tuple[int, bytes]:
        try:
            result = self.prober.run(body)
        except ProbeRequestError as e:
            return 400, json.dumps({"error": str(e)}).encode()
        return 200, json.dumps(result).encode()

    def close(self) -> None:
        """Stop the tokenizer workers (after the gRPC server has drained)."""
        self.router.close()
