"""A replica of the log: an ``Index`` kept equal to the log, for a server or any Python process.

``LogNode`` is what ``serve --event-log`` runs around its own index: the follower (reads and
applies the log, snapshots, readiness), and unless read-only the appender (group commit) and
the upkeep thread (ticks, trimming). ``Replica`` is the small public API for a process that only
wants answers: its own index, router and follower, and ``lookup(request)`` returning exactly
what ``LookupRoute`` would (``inferencecache gateway --event-log`` uses it instead of a gRPC
hop)::

    from inferencecache.eventlog import EventLogConfig, Replica
    from inferencecache.index import LookupRequest

    with Replica(EventLogConfig("redis://127.0.0.1:6379/0")) as replica:
        replica.wait_ready(10)
        result = replica.lookup(LookupRequest(tenant_id="t", model_id="m", hash_scheme="s",
                                              block_hashes=packed, packed_hashes=True,
                                              block_token_counts=counts))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from concurrent.futures import Future
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry

from inferencecache.eventlog.appender import Appender
from inferencecache.eventlog.applier import Applier, ItemApplier
from inferencecache.eventlog.config import EventLogConfig
from inferencecache.eventlog.follower import Follower
from inferencecache.eventlog.metrics import EventLogMetrics
from inferencecache.eventlog.redislog import LogUnavailable, RedisLog
from inferencecache.eventlog.snapshot import SnapshotStore
from inferencecache.eventlog.upkeep import Upkeep
from inferencecache.index.backends import store_factory
from inferencecache.index.facade import Index
from inferencecache.index.lookup_route import PromptTokenizer, Router
from inferencecache.index.metrics import IndexMetrics
from inferencecache.index.model import CacheState, LookupRequest, LookupResult
from inferencecache.index.settings import IndexSettings
from inferencecache.index.tenant_config import IndexConfig

log = logging.getLogger("inferencecache.eventlog")

RETENTION_MARGIN_S = 600.0


def settings_doc(settings: IndexSettings) -> bytes:
    """The index settings that shape the state, as published in ``{PREFIX}:settings``."""
    return json.dumps(dataclasses.asdict(settings), sort_keys=True,
                      separators=(",", ":")).encode()


def published_settings(config: EventLogConfig) -> IndexSettings | None:
    """The index settings the last appending replica published (``{PREFIX}:settings``), or
    None when there are none or Redis does not answer: a read-only replica adopts them so it
    holds exactly the servers' state."""
    log_ = RedisLog(config.url, password=config.password, key_prefix=config.key_prefix,
                    socket_timeout=min(config.socket_timeout, 2.0))
    client = log_.client()
    try:
        raw: Any = client.get(log_.keys.settings)
        if raw is None:
            return None
        doc = json.loads(raw)
        names = {f.name for f in dataclasses.fields(IndexSettings)}
        return IndexSettings(**{k: v for k, v in doc.items() if k in names})
    except Exception as e:
        log.warning("could not read the event log's published settings; using defaults",
                    extra={"err": f"{type(e).__name__}: {e}"})
        return None
    finally:
        client.close()


class LogNode:
    """The event-log side of one replica around an existing ``Index``."""

    def __init__(
        self,
        index: Index,
        config: EventLogConfig,
        metrics: EventLogMetrics,
        *,
        read_only: bool = False,
        items: ItemApplier | None = None,
    ) -> None:
        self.index = index
        self.config = config
        self.metrics = metrics
        self.log = RedisLog(config.url, password=config.password, key_prefix=config.key_prefix,
                            socket_timeout=config.socket_timeout)
        snapshots = SnapshotStore(config.snapshot_dir) if config.snapshot_dir else None
        # items: how an update/event item reaches the index (default: Index.apply_update /
        # apply_event after the one decoder); a server with another apply path passes its own
        self.applier = Applier(index, metrics, items=items)
        self.follower = Follower(
            index, self.log, metrics, applier=self.applier, snapshots=snapshots,
            write_snapshots=config.write_snapshots, snapshot_interval=config.snapshot_interval,
            max_lag=config.max_replica_lag, settings_doc=settings_doc(index.settings),
            publish_settings=not read_only,
        )
        self.appender: Appender | None = None
        self.upkeep: Upkeep | None = None
        if not read_only:
            self.appender = Appender(self.log, metrics)
            self.upkeep = Upkeep(
                self.appender, lambda: self.applier.time.clock_us,
                sweep_interval=index.settings.sweep_interval, retention=self.retention,
            )

    def retention(self) -> float:
        """Seconds of log kept: ``--event-log-retention``, else the largest TTL + 10 min."""
        if self.config.retention > 0:
            return self.config.retention
        config = self.index.config
        ttl = self.index.settings.default_ttl
        for p in config.policies.values():
            if math.isfinite(p.eviction_ttl) and p.eviction_ttl > ttl:
                ttl = p.eviction_ttl
        return ttl + RETENTION_MARGIN_S

    def start(self) -> None:
        self.follower.start()
        if self.appender is not None:
            self.appender.start()
        if self.upkeep is not None:
            self.upkeep.start()
        log.info("following the event log", extra={"log": self.log.describe(),
                                                   "appending": self.appender is not None})

    def submit(self, kind: int, payload: bytes) -> Future[None]:
        if self.appender is None:
            raise LogUnavailable("read-only replica")
        return self.appender.submit(kind, payload)

    @property
    def ready(self) -> bool:
        return self.follower.ready

    def stop(self) -> None:
        if self.upkeep is not None:
            self.upkeep.stop()
        if self.appender is not None:
            self.appender.close()
        self.follower.stop()


class Replica:
    """A read-only replica in this process (see the module doc). Thread-safe ``lookup``."""

    def __init__(
        self,
        config: EventLogConfig,
        *,
        settings: IndexSettings | None = None,
        policy: IndexConfig | None = None,
        tokenizer: PromptTokenizer | None = None,
        store_backend: str | None = None,
        registry: CollectorRegistry | None = None,
        index_metrics: IndexMetrics | None = None,
    ) -> None:
        self.index = Index(settings, config=policy, store_factory=store_factory(store_backend),
                           metrics=index_metrics)
        self.router = Router(self.index, tokenizer=tokenizer)
        self.metrics = EventLogMetrics(registry)
        self.node = LogNode(self.index, config, self.metrics, read_only=True)
        self._started = False

    def start(self) -> Replica:
        if not self._started:
            self._started = True
            self.node.start()
        return self

    def close(self) -> None:
        if self._started:
            self.node.stop()
        self.router.close()

    def __enter__(self) -> Replica:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def ready(self) -> bool:
        return self.node.ready

    def wait_ready(self, timeout: float) -> bool:
        """Block until caught up to within ``max_replica_lag`` of the log head."""
        return self.node.follower.wait_ready(timeout)

    def lookup(self, request: LookupRequest) -> LookupResult:
        """Exactly what LookupRoute answers for ``request`` on any replica at this position."""
        return self.router.lookup(request)

    def cache_state(self, tenant_id: str, model_id: str) -> CacheState:
        """GetCacheState."""
        return self.index.cache_state(tenant_id, model_id)

    @property
    def sequence(self) -> int:
        """Sequence number of the last applied entry."""
        return self.node.follower.position.seq
