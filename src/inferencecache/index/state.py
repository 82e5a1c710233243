"""The index state (contract-and-index.md §3): partitions of holds, the secondary views, stats rows.

Holds live in one ``PartitionStore`` per ``(tenant, model, hash_scheme, adapter)``; everything
else here is small and derived. Every mutation of a store goes through the view-maintenance
primitives below (``added``, ``removed``), which keep the views equal to what a recount of the
holds would give (``verify`` recounts; the stateful tests call it after every step).

Views (all exact, entries dropped at 0):
- ``keys_by_tenant[t]``, ``keys_by_tm[(t, m)]``: distinct keys (quota, classifier).
- ``serving[(t, m, s)][replica_id_int]``: holds of the replica in the scope, any adapter
  (DP denominator, TENANT_HOT serving check, affinity set, classifier).
- ``stats[(t, m)][replica_id_int]``: stats rows; the inner dict's keys are ``stats_replicas``.
- ``total_keys`` (cold-start check, probe included), ``total_holds``, ``reserved_holds`` (probe
  tenant holds; the cap counts ``total_holds - reserved_holds``), ``entries_by_model`` (distinct
  keys per model without the probe tenant: the ``index_entries`` gauge).

Not thread-safe by itself: the ``Index`` facade serialises every call under one lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from inferencecache.index.changes import Change
from inferencecache.index.keys import IdPool, Interner
from inferencecache.index.metrics import IndexMetrics
from inferencecache.index.model import PROBE_TENANT
from inferencecache.index.settings import IndexSettings
from inferencecache.index.store import PartitionOps, PartitionStore
from inferencecache.index.tenant_config import PolicyTable

if TYPE_CHECKING:
    from inferencecache.index.eviction import CapPool

PartKey = tuple[str, str, str, str]
Scope = tuple[str, str, str]
TenantModel = tuple[str, str]


class Partition:
    """One ``(tenant, model, hash_scheme, adapter)`` and its store."""

    __slots__ = (
        "adapter",
        "key",
        "model",
        "ops",
        "pid",
        "probe",
        "scheme",
        "scope",
        "store",
        "tenant",
        "tm",
    )

    def __init__(self, pid: int, key: PartKey, store: PartitionStore) -> None:
        self.pid = pid
        self.key = key
        self.tenant, self.model, self.scheme, self.adapter = key
        self.tm: TenantModel = (self.tenant, self.model)
        self.scope: Scope = (self.tenant, self.model, self.scheme)
        self.probe = self.tenant == PROBE_TENANT
        self.store = store
        self.ops = PartitionOps(store)  # the optional capabilities, bound once
    def __repr__(self) -> str:
        return f"Partition({self.pid}, {self.key!r})"


class StatsRow:
    """One ``(tenant, model, replica)`` stats row; times in µs (contract-and-index.md §3)."""

    __slots__ = (
        "cache_memory_bytes",
        "hit_rate",
        "last_seen",
        "pressure",
        "stats_reported",
        "t2_hit_tokens",
        "t2_query_tokens",
    )

    def __init__(
        self,
        cache_memory_bytes: int,
        hit_rate: float,
        pressure: float,
        t2_hit_tokens: int,
        t2_query_tokens: int,
        ts: int,
    ) -> None:
        self.cache_memory_bytes = cache_memory_bytes
        self.hit_rate = hit_rate
        self.pressure = pressure
        self.t2_hit_tokens = t2_hit_tokens
        self.t2_query_tokens = t2_query_tokens
        self.last_seen = ts
        self.stats_reported = ts


class IndexState:
    """Partitions, views and stats rows, plus the pending metric deltas of one operation."""

    def __init__(
        self,
        settings: IndexSettings,
        store_factory: Callable[[], PartitionStore],
        metrics: IndexMetrics,
        policies: PolicyTable,
    ) -> None:
        self.settings = settings
        self.store_factory = store_factory
        self.metrics = metrics
        self.policies = policies
        self.replicas = Interner()
        self._pids = IdPool()
        self._shape = 0  # partitions created or dropped (see ``generation``)
        self.parts: dict[PartKey, Partition] = {}
        self.parts_by_tm: dict[TenantModel, dict[int, Partition]] = {}
        self.parts_by_tenant: dict[str, dict[int, Partition]] = {}
        self.keys_by_tenant: dict[str, int] = {}
        self.keys_by_tm: dict[TenantModel, int] = {}
        self.serving: dict[Scope, dict[int, int]] = {}
        self.stats: dict[TenantModel, dict[int, StatsRow]] = {}
        self.total_keys = 0
        self.total_holds = 0
        self.reserved_holds = 0
        self.entries_by_model: dict[str, int] = {}
        self._dirty_models: set[str] = set()
        self.dropped: Counter[str] = Counter()
        self.cap_pool: CapPool | None = None  # next global-cap victims (eviction.CapPool)
        # What the per-producer bounds count (index/bounds.py): partitions + stats scopes per
        # tenant, and scopes (serving or stats) per replica within a (tenant, model).
        self.tenant_refs: dict[str, int] = {}
        self.replicas_by_tm: dict[TenantModel, dict[int, int]] = {}
        self.stats_rows = 0
        # the change feed's list for the current operation, None while nobody observes
        # (index/changes.py); ``change_now`` is that operation's clock for removals
        self.changes: list[Change] | None = None
        self.change_now = 0

    # -- partitions -----------------------------------------------------------------------

    def partition(self, tenant: str, model: str, scheme: str, adapter: str) -> Partition:
        key = (tenant, model, scheme, adapter)
        part = self.parts.get(key)
        if part is None:
            part = Partition(self._pids.take(), key, self.store_factory())
            self._shape += 1
            self.parts[key] = part
            self.parts_by_tm.setdefault(part.tm, {})[part.pid] = part
            self.parts_by_tenant.setdefault(tenant, {})[part.pid] = part
            self._tenant_ref(tenant, 1)
        return part

    def _tenant_ref(self, tenant: str, d: int) -> None:
        n = self.tenant_refs.get(tenant, 0) + d
        if n:
            self.tenant_refs[tenant] = n
        else:
            del self.tenant_refs[tenant]

    def _tm_replica(self, tm: TenantModel, rid: int, d: int) -> None:
        by = self.replicas_by_tm.get(tm)
        if by is None:
            by = self.replicas_by_tm[tm] = {}
        n = by.get(rid, 0) + d
        if n:
            by[rid] = n
        else:
            del by[rid]
            if not by:
                del self.replicas_by_tm[tm]

    def drop_if_empty(self, part: Partition) -> None:
        """Forget a partition whose last key is gone (keeps scans and memory proportional)."""
        if part.store.key_count() or self.parts.get(part.key) is not part:
            return
        del self.parts[part.key]
        self._shape += 1
        by_tm = self.parts_by_tm[part.tm]
        del by_tm[part.pid]
        if not by_tm:
            del self.parts_by_tm[part.tm]
        by_t = self.parts_by_tenant[part.tenant]
        del by_t[part.pid]
        if not by_t:
            del self.parts_by_tenant[part.tenant]
        self._tenant_ref(part.tenant, -1)
        self._pids.give(part.pid)

    @property
    def generation(self) -> int:
        """Moves whenever a partition or a replica id is created or freed: what a cache of
        partitions and replica ids by name (``batch.resolver``) checks."""
        return self._shape + self.replicas.generation

    # -- view maintenance -----------------------------------------------------------------

    def keys_delta(self, part: Partition, d: int) -> None:
        if not d:
            return
        self.total_keys += d
        t = part.tenant
        n = self.keys_by_tenant.get(t, 0) + d
        if n:
            self.keys_by_tenant[t] = n
        else:
            del self.keys_by_tenant[t]
        tm = part.tm
        n = self.keys_by_tm.get(tm, 0) + d
        if n:
            self.keys_by_tm[tm] = n
        else:
            del self.keys_by_tm[tm]
        if not part.probe:
            m = part.model
            self.entries_by_model[m] = self.entries_by_model.get(m, 0) + d
            self._dirty_models.add(m)

    def holds_delta(self, part: Partition, rid: int, d: int) -> None:
        if not d:
            return
        self.total_holds += d
        if part.probe:
            self.reserved_holds += d
        scope = part.scope
        sv = self.serving.get(scope)
        if sv is None:
            sv = self.serving[scope] = {}
        cur = sv.get(rid)
        n = (cur or 0) + d
        if n > 0:
            if cur is None:
                self.replicas.ref(rid)
                self._tm_replica(part.tm, rid, 1)
            sv[rid] = n
        else:
            if n < 0:
                raise RuntimeError(f"serving count below zero for replica {rid} in {scope!r}")
            if cur is not None:
                del sv[rid]
                self.replicas.unref(rid)
                self._tm_replica(part.tm, rid, -1)
            if not sv:
                del self.serving[scope]

    def added(self, part: Partition, rid: int, new_keys: int, new_holds: int) -> None:
        """Account for an upsert into ``part`` by replica ``rid``."""
        if new_keys:
            self.keys_delta(part, new_keys)
        if new_holds:
            self.holds_delta(part, rid, new_holds)

    def changed(self, part: Partition, rid: int, keys: int, holds: int) -> None:
        """Account for one store call's net change by replica ``rid`` (added when positive,
        removed when negative; a partition left without keys is dropped)."""
        if keys:
            self.keys_delta(part, keys)
        if holds:
            self.holds_delta(part, rid, holds)
        if keys < 0:
            self.drop_if_empty(part)

    def removed_per_replica(self, part: Partition, per_replica: dict[int, int], keys: int) -> None:
        """Account for removals from ``part`` (holds per replica, keys) and drop it if empty."""
        for rid, n in per_replica.items():
            self.holds_delta(part, rid, -n)
        self.keys_delta(part, -keys)
        self.drop_if_empty(part)

    # -- stats rows -----------------------------------------------------------------------

    def put_stats(self, tm: TenantModel, rid: int, row: StatsRow) -> None:
        rows = self.stats.get(tm)
        if rows is None:
            rows = self.stats[tm] = {}
            self._tenant_ref(tm[0], 1)
        if rid not in rows:
            self.replicas.ref(rid)
            self._tm_replica(tm, rid, 1)
            self.stats_rows += 1
        rows[rid] = row

    def drop_stats(self, tm: TenantModel, rid: int) -> bool:
        rows = self.stats.get(tm)
        if rows is None or rows.pop(rid, None) is None:
            return False
        self.replicas.unref(rid)
        self._tm_replica(tm, rid, -1)
        self.stats_rows -= 1
        if not rows:
            del self.stats[tm]
            self._tenant_ref(tm[0], -1)
        return True

    def mark_models_dirty(self, models: dict[str, int] | set[str]) -> None:
        """Have ``finish`` re-set the ``index_entries`` gauge of these models (a state swap)."""
        self._dirty_models.update(models)

    # -- end of an operation --------------------------------------------------------------

    def finish(self) -> None:
        """Flush metric deltas and free unreferenced replica ids (end of every mutation)."""
        if not (self.dropped or self._dirty_models or self.replicas.pending):
            return
        metrics = self.metrics
        if self.dropped:
            for reason, n in self.dropped.items():
                metrics.ingest_dropped(reason, n)
            self.dropped.clear()
        if self._dirty_models:
            entries = self.entries_by_model
            for m in self._dirty_models:
                n = entries.get(m, 0)
                metrics.index_entries(m, n)
                if n == 0:
                    entries.pop(m, None)
            self._dirty_models.clear()
        self.replicas.collect()

    # -- invariants -----------------------------------------------------------------------

    def verify(self) -> list[str]:
        """Recount every view from the holds; returns the differences (empty when sound)."""
        problems: list[str] = []
        keys_by_tenant: Counter[str] = Counter()
        keys_by_tm: Counter[TenantModel] = Counter()
        serving: dict[Scope, Counter[int]] = {}
        entries: Counter[str] = Counter()
        total_keys = total_holds = reserved = 0
        for key, part in self.parts.items():
            if part.key != key:
                problems.append(f"partition {part!r} filed under {key!r}")
            holds = list(part.store.holds())
            distinct = {h.key for h in holds}
            if not distinct:
                problems.append(f"empty partition {part!r} kept")
            if len(distinct) != part.store.key_count():
                problems.append(f"{part!r}: key_count {part.store.key_count()} != {len(distinct)}")
            if len(holds) != part.store.hold_count():
                problems.append(f"{part!r}: hold_count {part.store.hold_count()} != {len(holds)}")
            if len({(h.key, h.replica) for h in holds}) != len(holds):
                problems.append(f"{part!r}: duplicate hold")
            keys_by_tenant[part.tenant] += len(distinct)
            keys_by_tm[part.tm] += len(distinct)
            total_keys += len(distinct)
            total_holds += len(holds)
            if part.probe:
                reserved += len(holds)
            else:
                entries[part.model] += len(distinct)
            sv = serving.setdefault(part.scope, Counter())
            for h in holds:
                sv[h.replica] += 1
                if self.replicas.names[h.replica] is None:
                    problems.append(f"{part!r}: hold of freed replica id {h.replica}")
            if self.parts_by_tm.get(part.tm, {}).get(part.pid) is not part:
                problems.append(f"{part!r} missing from parts_by_tm")
            if self.parts_by_tenant.get(part.tenant, {}).get(part.pid) is not part:
                problems.append(f"{part!r} missing from parts_by_tenant")
        n_by_tm = sum(len(v) for v in self.parts_by_tm.values())
        n_by_t = sum(len(v) for v in self.parts_by_tenant.values())
        if n_by_tm != len(self.parts) or n_by_t != len(self.parts):
            problems.append("partition indexes out of sync")
        if dict(keys_by_tenant) != self.keys_by_tenant:
            problems.append(f"keys_by_tenant {self.keys_by_tenant} != {dict(keys_by_tenant)}")
        if dict(keys_by_tm) != self.keys_by_tm:
            problems.append(f"keys_by_tm {self.keys_by_tm} != {dict(keys_by_tm)}")
        want_serving = {s: dict(c) for s, c in serving.items() if c}
        if want_serving != self.serving:
            problems.append(f"serving {self.serving} != {want_serving}")
        if total_keys != self.total_keys:
            problems.append(f"total_keys {self.total_keys} != {total_keys}")
        if total_holds != self.total_holds:
            problems.append(f"total_holds {self.total_holds} != {total_holds}")
        if reserved != self.reserved_holds:
            problems.append(f"reserved_holds {self.reserved_holds} != {reserved}")
        have_entries = {m: n for m, n in self.entries_by_model.items() if n}
        if have_entries != dict(entries):
            problems.append(f"entries_by_model {self.entries_by_model} != {dict(entries)}")
        refs: Counter[int] = Counter()
        for sv2 in self.serving.values():
            refs.update(sv2.keys())
        for rows in self.stats.values():
            if not rows:
                problems.append("empty stats bucket kept")
            refs.update(rows.keys())
        for name, rid in self.replicas.items():
            if self.replicas.refs(rid) != refs.get(rid, 0):
                problems.append(
                    f"replica {name!r} refs {self.replicas.refs(rid)} != {refs.get(rid, 0)}"
                )
            if refs.get(rid, 0) == 0:
                problems.append(f"replica {name!r} interned without references")
        for rid in refs:
            if self.replicas.names[rid] is None:
                problems.append(f"referenced replica id {rid} is free")
        tenant_refs: Counter[str] = Counter(p.tenant for p in self.parts.values())
        tenant_refs.update(tm[0] for tm in self.stats)
        if dict(tenant_refs) != self.tenant_refs:
            problems.append(f"tenant_refs {self.tenant_refs} != {dict(tenant_refs)}")
        by_tm: dict[TenantModel, Counter[int]] = {}
        for (t, m, _s), sv3 in self.serving.items():
            by_tm.setdefault((t, m), Counter()).update(sv3.keys())
        for tm, rows in self.stats.items():
            by_tm.setdefault(tm, Counter()).update(rows.keys())
        if {tm: dict(c) for tm, c in by_tm.items()} != self.replicas_by_tm:
            problems.append(f"replicas_by_tm {self.replicas_by_tm} != {by_tm}")
        n_rows = sum(len(rows) for rows in self.stats.values())
        if n_rows != self.stats_rows:
            problems.append(f"stats_rows {self.stats_rows} != {n_rows}")
        return problems
