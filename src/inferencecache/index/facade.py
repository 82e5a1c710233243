"""``Index``: the thread-safe facade the server calls for ingest, events, sweep and reads.

Concurrency: one lock serialises every mutation (update, event, sweep, config swap) and the index
part of a lookup (``Router``), so a lookup sees each update either entirely or not at all. Work
that can block for long (prompt tokenization) never runs under the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar, TypeVarTuple

from inferencecache.index import apply, batch, eviction, persist
from inferencecache.index.backends import default_store_factory
from inferencecache.index.changes import DEFAULT_MAX_BACKLOG, ChangeFeed, Observer
from inferencecache.index.clock import Clock, SystemClock
from inferencecache.index.metrics import IndexMetrics, NullMetrics
from inferencecache.index.model import PROBE_TENANT, CacheState, EventLike, PackedUpdate, UpdateLike
from inferencecache.index.settings import IndexSettings
from inferencecache.index.state import IndexState
from inferencecache.index.store import PartitionStore
from inferencecache.index.tenant_config import EffectivePolicy, IndexConfig, PolicyTable

_Ts = TypeVarTuple("_Ts")
_time_ns = time.time_ns
_T = TypeVar("_T")


class HoldView(NamedTuple):
    """One hold as ``Index.holds`` reports it (times in µs)."""

    partition: tuple[str, str, str, str]  # tenant, model, hash scheme, adapter
    key: bytes
    replica_id: str
    tokens: int
    last_seen_us: int
    tier: int
    access: int


class StatsView(NamedTuple):
    """One replica stats row as ``Index.stats_rows`` reports it (times in µs)."""

    tenant_model: tuple[str, str]
    replica_id: str
    cache_memory_bytes: int
    hit_rate: float
    pressure: float
    last_seen_us: int
    stats_reported_us: int


def _compiled_applier(
    store_factory: Callable[[], PartitionStore],
) -> Callable[[batch.Resolver], object] | None:
    """The compiled batch applier when the index keeps its holds in the compiled store (it
    writes BlockMaps directly); None otherwise (the reference applies every record)."""
    try:
        from inferencecache.index.nativestore import Applier, BlockMap
    except ImportError:
        return None
    return Applier if isinstance(store_factory(), BlockMap) else None


class Index:
    """The routing index (contract-and-index.md §3-§7). Every public method is atomic to lookups."""

    def __init__(
        self,
        settings: IndexSettings | None = None,
        *,
        clock: Clock | None = None,
        store_factory: Callable[[], PartitionStore] | None = None,
        metrics: IndexMetrics | None = None,
        config: IndexConfig | None = None,
    ) -> None:
        self.settings = settings if settings is not None else IndexSettings()
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.metrics: IndexMetrics = metrics if metrics is not None else NullMetrics()
        self.store_factory = store_factory if store_factory is not None else default_store_factory()
        self._lock = threading.Lock()
        self._state = IndexState(
            self.settings,
            self.store_factory,
            self.metrics,
            PolicyTable(config or IndexConfig(), self.settings.default_ttl_us),
        )
        self._sysclock = type(self.clock) is SystemClock  # now_us() = time_ns() // 1000
        self._compiled_batches = _compiled_applier(self.store_factory)
        self._batches = batch.Applier(self._state, self._compiled_batches)
        self.feed = ChangeFeed()

    # -- change feed (index/changes.py) ---------------------------------------------------

    def observe(self, max_backlog: int = DEFAULT_MAX_BACKLOG) -> Observer:
        """A new observer of every change applied from now on, in apply order; ``close()`` it
        when done. It is cut off (``Overflowed``) when it lags more than ``max_backlog``
        changes behind."""
        return self.feed.add(max_backlog)

    def _observe_begin(self, now: int) -> None:
        """Under the lock, before a mutation: collect its changes while anyone observes."""
        if self.feed.active:
            st = self._state
            st.changes = []
            st.change_now = now

    def _observe_end(self) -> None:
        """Under the lock, after a mutation: hand its changes to the observers."""
        st = self._state
        changes = st.changes
        if changes is not None:
            st.changes = None
            if changes:
                self.feed.publish(changes)

    # -- configuration --------------------------------------------------------------------

    @property
    def config(self) -> IndexConfig:
        return self._state.policies.config

    def replace_config(self, config: IndexConfig) -> None:
        """Swap the whole per-tenant configuration (replace-on-write,
        contract-and-index.md §6.7)."""
        table = PolicyTable(config, self.settings.default_ttl_us)
        with self._lock:
            self._state.policies = table
            self._state.cap_pool = None  # algorithms may have changed

    def policy(self, tenant_id: str) -> EffectivePolicy:
        """The effective policy of a tenant (defaults when it has no entry)."""
        return self._state.policies.by_tenant[tenant_id]

    def run_locked(self, fn: Callable[[IndexState, *_Ts], _T], *args: *_Ts) -> _T:
        """``fn(state, *args)`` under the index lock: how the lookup pipeline (and any other
        reader that must see one consistent index) reads the state. ``fn`` must not block, and
        must not keep ``state`` beyond the call."""
        with self._lock:
            return fn(self._state, *args)

    # -- ingest ---------------------------------------------------------------------------

    def apply_update(
        self,
        update: UpdateLike | PackedUpdate,
        *,
        allow_probe: bool = False,
        now_us: int | None = None,
    ) -> None:
        """Apply one CacheStateUpdate (contract-and-index.md §4.2), then the tenant quota and the
        global cap. The compact form of the server's wire parser (``PackedUpdate``) gives the same
        result. Writes under the reserved probe tenant are dropped unless ``allow_probe`` (the
        ``/probe`` self-test). ``now_us`` replaces the index clock for every time this update
        stamps or compares (a replica of the event log passes the log entry's time, so every
        replica stores the same state)."""
        now = self.clock.now_us() if now_us is None else now_us
        with self._lock:
            st = self._state  # read under the lock: replace_state swaps it
            self._observe_begin(now)
            try:
                if apply.apply_update(st, update, now, allow_probe=allow_probe):
                    tenant = update.tenant_id
                    if tenant != PROBE_TENANT:
                        eviction.enforce_quota(st, tenant)
                    eviction.enforce_cap(st)
            finally:
                self._observe_end()
                st.finish()

    def apply_batch(self, data: bytes, *, now_us: int | None = None) -> None:
        """Apply an ICB1 batch (``index/batch.py``: what the server's wire parsers make of an
        update or an eviction event), record by record, each exactly as the update or event it
        stands for; the probe tenant's records are skipped. ``now_us`` as in ``apply_update``
        (an event-log replica passes the log clock). ``batch.BatchError`` for bytes that are
        not a well-formed batch (records before the malformed one stay applied)."""
        if now_us is None:
            now_us = _time_ns() // 1000 if self._sysclock else self.clock.now_us()
        with self._lock:
            self._observe_begin(now_us)
            try:
                self._batches.apply(data, now_us)  # reports its changes while observed
            finally:
                self._observe_end()
                self._state.finish()

    def apply_event(
        self, event: EventLike, *, allow_probe: bool = False, now_us: int | None = None
    ) -> None:
        """Apply one CacheEvent (contract-and-index.md §4.4); a batched ``PREFIX_EVICTED``
        (``prefix_hashes``) applies every hash under this one lock. ``allow_probe`` and
        ``now_us`` as in ``apply_update``."""
        now = self.clock.now_us() if now_us is None else now_us
        with self._lock:
            st = self._state
            self._observe_begin(now)
            try:
                apply.apply_event(st, event, now, allow_probe=allow_probe)
            finally:
                self._observe_end()
                st.finish()

    def sweep(self, *, now_us: int | None = None) -> None:
        """TTL sweep (contract-and-index.md §6.2); the server calls it every ``sweep_interval``
        (an event-log replica at the log's time, ``now_us``)."""
        now = self.clock.now_us() if now_us is None else now_us
        with self._lock:
            st = self._state
            self._observe_begin(now)
            try:
                eviction.sweep(st, now)
            finally:
                self._observe_end()
                st.finish()

    # -- reads ----------------------------------------------------------------------------

    def cache_state(self, tenant_id: str, model_id: str) -> CacheState:
        """GetCacheState (contract-and-index.md §5.13)."""
        from inferencecache.index.snapshot import cache_state

        with self._lock:
            return cache_state(self._state, tenant_id, model_id)

    def snapshot(self) -> dict[str, object]:
        """The ``/snapshot`` document (contract-and-index.md §9.3), JSON-ready."""
        from inferencecache.index.snapshot import snapshot

        with self._lock:
            return snapshot(self._state)

    def counts(self) -> dict[str, int]:
        """Headline sizes: holds, keys (probe included), probe holds, partitions, replicas."""
        with self._lock:
            st = self._state
            return {
                "holds": st.total_holds,
                "keys": st.total_keys,
                "reserved_holds": st.reserved_holds,
                "partitions": len(st.parts),
                "replicas": len(st.replicas),
            }

    def holds(self) -> list[HoldView]:
        """Every hold, probe tenant included (inspection: tests, debugging; O(holds))."""
        with self._lock:
            st = self._state
            return [
                HoldView(part.key, h.key, st.replicas.name(h.replica), h.tokens, h.last_seen,
                         h.tier, h.access)
                for part in st.parts.values() for h in part.store.holds()
            ]  # fmt: skip

    def stats_rows(self) -> list[StatsView]:
        """Every replica stats row (inspection: tests, debugging)."""
        with self._lock:
            st = self._state
            return [
                StatsView(tm, st.replicas.name(rid), row.cache_memory_bytes, row.hit_rate,
                          row.pressure, row.last_seen, row.stats_reported)
                for tm, rows in st.stats.items() for rid, row in rows.items()
            ]  # fmt: skip

    # -- state as a whole (event-log snapshots, docs/event-log.md) ----------------------------

    def capture_state(self) -> persist.Capture:
        """The state at one consistent point (event-log snapshots): a plain copy taken under
        the lock (one compiled pass per partition); ``.blobs()`` encodes it outside the lock."""
        with self._lock:
            return persist.capture(self._state)

    def dump_state(self) -> list[bytes]:
        """``capture_state().blobs()``: the state as ``persist`` blobs (meta, then one per
        partition)."""
        return self.capture_state().blobs()

    def replace_state(self, blobs: list[bytes] | None) -> None:
        """Replace the whole state by an empty one (``None``) or by ``dump_state`` blobs.

        The new state is built outside the lock and swapped in at once; on a bad dump
        (``persist.PersistError``) the current state stays. The replica name list object is
        kept (``Router`` holds it), and every model's ``index_entries`` gauge is re-set."""
        fresh = IndexState(self.settings, self.store_factory, self.metrics, self._state.policies)
        if blobs is not None:
            if not blobs:
                raise persist.PersistError("empty dump")
            persist.load(fresh, blobs[0], blobs[1:])
        with self._lock:
            old = self._state
            names = old.replicas.names
            names[:] = fresh.replicas.names
            fresh.replicas._names = names
            fresh.policies = old.policies
            fresh.mark_models_dirty(old.entries_by_model)
            fresh.mark_models_dirty(fresh.entries_by_model)
            self._state = fresh
            # the batch applier caches partitions and replica ids of one state
            self._batches = batch.Applier(fresh, self._compiled_batches)
            fresh.finish()
            # observers' changes no longer lead to this state: they must resync
            self.feed.state_replaced()

    def verify(self) -> list[str]:
        """Recount every view from the holds (tests; O(holds))."""
        with self._lock:
            return self._state.verify()
