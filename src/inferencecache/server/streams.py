"""The two server-streaming RPCs (contract-and-index.md §13): ``StreamCacheEvents`` (the index's
change feed, ``index/changes.py``) and ``StreamMetrics`` (periodic samples of this server's
Prometheus registry).

Why a slot cap: grpcio's sync server runs each open stream on one worker thread for the stream's
whole life. ``--max-streams`` (clamped to half of ``--grpc-workers``) bounds how many may be open
at once, so observers can never take every worker from LookupRoute and ingest; one stream more
is refused with ``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from inferencecache.index.changes import (
    Change,
    Closed,
    Observer,
    Overflowed,
    Replaced,
    matches,
)
from inferencecache.index.model import PROBE_TENANT
from inferencecache.metrics import LazyChildren
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

log = logging.getLogger("inferencecache.server")

DEFAULT_MAX_STREAMS = 32
DEFAULT_MAX_BACKLOG = 100_000
DEFAULT_METRICS_INTERVAL = 5.0
_POLL_S = 0.5  # how often a waiting stream notices a client cancel or a shutdown

_METRIC_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram",
                 "gaugehistogram": "histogram", "info": "gauge", "stateset": "gauge",
                 "summary": "summary", "unknown": "untyped"}  # fmt: skip


class Aborted(Exception):
    """Raised after ``context.abort`` so the handler stops; grpcio keeps the abort status."""


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    try:
        context.abort(code, message)
    except Exception as e:  # grpcio's abort raises a bare Exception
        raise Aborted(message) from e


@dataclass(frozen=True)
class StreamSettings:
    """The streams' knobs (``serve`` flags of the same names)."""

    max_streams: int = DEFAULT_MAX_STREAMS
    max_backlog: int = DEFAULT_MAX_BACKLOG
    metrics_interval: float = DEFAULT_METRICS_INTERVAL


class StreamMetricsSet:
    """The streams' own metrics (registered in the server registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.open = Gauge(
            "inferencecache_server_open_streams",
            "Open StreamCacheEvents / StreamMetrics streams.",
            ["method"],
            registry=registry,
        )
        self.disconnects = Counter(
            "inferencecache_server_stream_disconnects",
            "Streams the server ended or refused: overflow (an observer fell more than "
            "--stream-max-backlog changes behind), refused (--max-streams reached) or replaced "
            "(the index state was swapped by a snapshot load).",
            ["method", "reason"],
            registry=registry,
        )


class _Slot:
    """One held stream slot, released exactly once (by the generator's end or grpcio's
    termination callback, whichever comes first)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._done = False

    def release(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._release()


class Streams:
    """Serves both streams; ``close()`` ends every open one (server shutdown)."""

    def __init__(
        self,
        observe: Callable[[int], Observer] | None,
        registry: CollectorRegistry,
        settings: StreamSettings | None = None,
    ) -> None:
        self.settings = settings if settings is not None else StreamSettings()
        self._observe = observe
        self._registry = registry
        self._slots = threading.BoundedSemaphore(max(1, self.settings.max_streams))
        self._stopping = threading.Event()
        m = StreamMetricsSet(registry)
        self._open = LazyChildren(m.open)
        self._disconnects = LazyChildren(m.disconnects)
        self._observers: set[Observer] = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        self._stopping.set()
        with self._lock:
            observers = list(self._observers)
        for obs in observers:
            obs.close()

    # -- admission ------------------------------------------------------------------------------

    def _admit(self, method: str, context: grpc.ServicerContext) -> _Slot:
        if self._stopping.is_set():
            _abort(context, grpc.StatusCode.UNAVAILABLE, f"{method}: server shutting down")
        if not self._slots.acquire(blocking=False):
            self._disconnects(method, "refused").inc()
            _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: too many open streams (--max-streams {self.settings.max_streams})",
            )
        gauge = self._open(method)
        gauge.inc()

        def release() -> None:
            gauge.dec()
            self._slots.release()

        slot = _Slot(release)
        context.add_callback(slot.release)
        return slot

    # -- StreamCacheEvents ----------------------------------------------------------------------

    def cache_events(
        self, request: Any, context: grpc.ServicerContext, tenant: str, model: str
    ) -> Iterator[Any]:
        """The change feed filtered by ``tenant``/``model`` (empty = any; the caller decides
        the scope, see ``InferenceCacheService._stream_scope``) and ``request.types``."""
        method = "StreamCacheEvents"
        observe = self._observe
        if observe is None:
            _abort(context, grpc.StatusCode.UNIMPLEMENTED, f"{method}: no change feed")
            raise AssertionError("not reached: abort raises")
        slot = self._admit(method, context)
        try:
            obs = observe(self.settings.max_backlog)
        except BaseException:
            slot.release()
            raise
        with self._lock:
            self._observers.add(obs)
        context.add_callback(obs.close)
        types = {int(t) for t in request.types if int(t) != 0}
        return self._events(obs, slot, context, tenant, model, types)

    def _events(
        self,
        obs: Observer,
        slot: _Slot,
        context: grpc.ServicerContext,
        tenant: str,
        model: str,
        types: set[int],
    ) -> Iterator[Any]:
        method = "StreamCacheEvents"
        try:
            while context.is_active():
                try:
                    batch = obs.next_batch(_POLL_S)
                except Closed:
                    return
                except Replaced:
                    self._disconnects(method, "replaced").inc()
                    _abort(
                        context,
                        grpc.StatusCode.ABORTED,
                        f"{method}: the index state was replaced (event-log snapshot); "
                        "reconnect and resync with GetCacheState",
                    )
                except Overflowed:
                    self._disconnects(method, "overflow").inc()
                    log.warning(
                        "change stream observer too slow: disconnected",
                        extra={"max_backlog": self.settings.max_backlog,
                               "peer": _peer(context)},
                    )  # fmt: skip
                    _abort(
                        context,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{method}: observer fell more than {self.settings.max_backlog} changes "
                        "behind the index and was disconnected; reconnect and resync with "
                        "GetCacheState",
                    )
                for change in batch:
                    if change.tenant == PROBE_TENANT or not matches(change, tenant, model, types):
                        continue
                    yield from to_events(change)
        finally:
            obs.close()
            with self._lock:
                self._observers.discard(obs)
            slot.release()

    # -- StreamMetrics --------------------------------------------------------------------------

    def metrics(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """One round of samples at once, then one every ``metrics_interval`` seconds."""
        slot = self._admit("StreamMetrics", context)
        names = frozenset(request.names)
        return self._metric_rounds(slot, context, names)

    def _metric_rounds(
        self, slot: _Slot, context: grpc.ServicerContext, names: frozenset[str]
    ) -> Iterator[Any]:
        interval = max(0.01, self.settings.metrics_interval)
        try:
            next_at = time.monotonic()
            while context.is_active() and not self._stopping.is_set():
                yield from sample(self._registry, names)
                next_at += interval
                while context.is_active() and not self._stopping.is_set():
                    left = next_at - time.monotonic()
                    if left <= 0:
                        break
                    self._stopping.wait(min(left, _POLL_S))
        finally:
            slot.release()


def to_events(change: Change) -> Iterator[Any]:
    """One ``CacheEvent`` per hash (PREFIX_ADDED / PREFIX_EVICTED), or one per replica change."""
    ev: Any = pb.CacheEvent
    if change.hashes:
        for key in change.each_hash():
            yield ev(type=change.type, replica_id=change.replica, model_id=change.model,
                     tenant_id=change.tenant, prefix_hash=key, timestamp_us=change.timestamp_us,
                     adapter_id=change.adapter)  # fmt: skip
    else:
        yield ev(type=change.type, replica_id=change.replica, model_id=change.model,
                 tenant_id=change.tenant, timestamp_us=change.timestamp_us,
                 adapter_id=change.adapter)  # fmt: skip


def sample(registry: CollectorRegistry, names: frozenset[str]) -> list[Any]:
    """Every sample of ``registry`` now, as ``Metric`` messages. A sample is kept when
    ``names`` is empty or holds its sample name (as on ``/metrics``, e.g. ``..._total``,
    ``..._bucket``) or its family name."""
    now_us = time.time_ns() // 1000
    out: list[Any] = []
    for family in registry.collect():
        family_hit = not names or family.name in names
        kind = _METRIC_TYPES.get(family.type, family.type)
        for s in family.samples:
            if not family_hit and s.name not in names:
                continue
            if s.name == family.name + "_created":  # not on serve's /metrics either
                continue
            out.append(pb.Metric(name=s.name, type=kind, labels=s.labels, value=s.value,
                                 timestamp_us=now_us))  # fmt: skip
    return out


def _peer(context: grpc.ServicerContext) -> str:
    try:
        return str(context.peer())
    except Exception:
        return ""
