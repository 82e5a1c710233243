"""The index's metric sink (contract-and-index.md §9.1), injected so the index stays free of
prometheus.

The server binds these calls to its registry (``inferencecache_index_evictions_total`` etc.);
tests use ``RecordingMetrics``. Calls happen under the index lock at the end of an operation, so
keep implementations cheap and non-blocking (prometheus children are).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Protocol


class IndexMetrics(Protocol):
    def index_evictions(self, algorithm: str, reason: str, n: int) -> None:
        """``index_evictions_total{algorithm=lru|lfu, reason=ttl|cap} += n`` (holds)."""
        ...

    def tenant_evictions(self, tenant_id: str, reason: str, n: int) -> None:
        """``tenant_evictions_total{tenant_id, reason=over_entries} += n`` (keys)."""
        ...

    def ingest_dropped(self, reason: str, n: int) -> None:
        """``ingest_dropped_total{reason} += n`` (prefix entries dropped at ingest)."""
        ...

    def index_entries(self, model: str, n: int) -> None:
        """``index_entries{model} = n`` (distinct keys of the model, probe tenant excluded)."""
        ...


class NullMetrics:
    """Discards everything (the default)."""

    __slots__ = ()

    def index_evictions(self, algorithm: str, reason: str, n: int) -> None:
        pass

    def tenant_evictions(self, tenant_id: str, reason: str, n: int) -> None:
        pass

    def ingest_dropped(self, reason: str, n: int) -> None:
        pass

    def index_entries(self, model: str, n: int) -> None:
        pass


class RecordingMetrics:
    """Keeps every value in memory (tests, and a reference for the server binding)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.evictions: Counter[tuple[str, str]] = Counter()
        self.tenant_evicted: Counter[tuple[str, str]] = Counter()
        self.dropped: Counter[str] = Counter()
        self.entries: dict[str, int] = {}
        self.entries_calls = 0

    def index_evictions(self, algorithm: str, reason: str, n: int) -> None:
        with self._lock:
            self.evictions[(algorithm, reason)] += n

    def tenant_evictions(self, tenant_id: str, reason: str, n: int) -> None:
        with self._lock:
            self.tenant_evicted[(tenant_id, reason)] += n

    def ingest_dropped(self, reason: str, n: int) -> None:
        with self._lock:
            self.dropped[reason] += n

    def index_entries(self, model: str, n: int) -> None:
        with self._lock:
            self.entries[model] = n
            self.entries_calls += 1
