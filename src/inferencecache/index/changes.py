"""The index's change feed (contract-and-index.md §13): what every apply call changed, handed to
observers in apply order without ever making ingest or lookups wait for them.

Why here and not in the server: every path that mutates the index (direct ingest, an ICB1 batch,
an event log applied by another process's appender, the sweep) goes through ``Index``, so a feed
at this level sees them all. The apply functions append one compact ``Change`` per store call
(packed hashes stay packed) to ``IndexState.changes`` only while someone observes (``None``
otherwise: one attribute test per call, nothing else); the facade hands that list to
``ChangeFeed.publish`` before it releases the lock, which does one non-blocking put per
observer. Expanding a change into per-hash events and filtering happen in the observer's own
thread.

An observer whose backlog exceeds its bound is cut off by the publisher (O(1)): it is removed
from the feed and its reader sees ``Overflowed`` on its next read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from inferencecache.index.model import EventType

PREFIX_ADDED = int(EventType.PREFIX_ADDED)
PREFIX_EVICTED = int(EventType.PREFIX_EVICTED)
REPLICA_UPDATED = int(EventType.REPLICA_UPDATED)
ALL_CLEARED = int(EventType.ALL_CLEARED)

DEFAULT_MAX_BACKLOG = 100_000
"""Changes (not events: one change may carry many hashes) an observer may lag behind."""


class Change(NamedTuple):
    """One change of one apply call. ``hashes`` is packed 8-byte keys (``bytes``) or a sequence
    of keys; empty for REPLICA_UPDATED and ALL_CLEARED."""

    type: int
    tenant: str
    model: str
    adapter: str
    replica: str
    hashes: bytes | Sequence[bytes]
    timestamp_us: int

    def each_hash(self) -> Iterator[bytes]:
        """Each hash of the change, in order."""
        h = self.hashes
        if isinstance(h, bytes):
            return (h[i : i + 8] for i in range(0, len(h) - len(h) % 8, 8))
        return iter(h)


class Overflowed(Exception):
    """The observer fell further behind than its bound and was disconnected."""


class Replaced(Exception):
    """The index state was replaced wholesale (an event-log snapshot load): the changes since
    the observer started no longer describe it; resync."""


class Closed(Exception):
    """The observer was closed (server shutdown or the reader went away)."""


class Observer:
    """One reader's bounded backlog of change lists. ``publish`` runs under the index lock (one
    thread at a time); ``next_batch`` runs in the reader's thread."""

    def __init__(self, feed: ChangeFeed, max_backlog: int) -> None:
        self._feed = feed
        self._max = max_backlog
        self._q: deque[Sequence[Change]] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._pending = 0
        self.overflowed = False
        self.replaced = False
        self.closed = False

    def _offer(self, changes: Sequence[Change]) -> bool:
        """Called by the publisher; False when this put overflowed the observer."""
        with self._cv:
            if self.closed or self.overflowed or self.replaced:
                return False
            self._pending += len(changes)
            if self._pending > self._max:
                self.overflowed = True
                self._q.clear()
                self._cv.notify()
                return False
            self._q.append(changes)
            self._cv.notify()
            return True

    def next_batch(self, timeout: float | None) -> Sequence[Change]:
        """The next change list in apply order; ``[]`` after ``timeout`` seconds with nothing.
        ``Overflowed`` / ``Closed`` when the observer was cut off."""
        with self._cv:
            if not self._q and not (self.overflowed or self.replaced or self.closed):
                self._cv.wait(timeout)
            if self.overflowed:
                raise Overflowed
            if self.replaced:
                raise Replaced
            if self.closed:
                raise Closed
            if not self._q:
                return []
            batch = self._q.popleft()
            self._pending -= len(batch)
            return batch

    @property
    def backlog(self) -> int:
        return self._pending

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify()
        self._feed.remove(self)

    def _replace(self) -> None:
        with self._cv:
            self.replaced = True
            self._q.clear()
            self._pending = 0
            self._cv.notify()


class ChangeFeed:
    """The set of observers of one index. ``active`` is what the apply path tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._observers: tuple[Observer, ...] = ()
        self.overflows = 0  # observers cut off so far (the server exports it as a metric)

    @property
    def active(self) -> bool:
        return bool(self._observers)

    @property
    def count(self) -> int:
        return len(self._observers)

    def add(self, max_backlog: int = DEFAULT_MAX_BACKLOG) -> Observer:
        obs = Observer(self, max_backlog)
        with self._lock:
            self._observers = (*self._observers, obs)
        return obs

    def remove(self, obs: Observer) -> None:
        with self._lock:
            self._observers = tuple(o for o in self._observers if o is not obs)

    def publish(self, changes: Sequence[Change]) -> None:
        """Give one apply call's changes to every observer (non-blocking)."""
        for obs in self._observers:
            if not obs._offer(changes):
                if obs.overflowed:
                    self.overflows += 1
                self.remove(obs)

    def state_replaced(self) -> None:
        """Cut every observer off with ``Replaced`` (the index state was swapped)."""
        with self._lock:
            observers, self._observers = self._observers, ()
        for obs in observers:
            obs._replace()

    def close_all(self) -> None:
        for obs in self._observers:
            obs.close()


def matches(change: Change, tenant: str, model: str, types: Iterable[int] | None) -> bool:
    """Whether a change passes an observer's filter (empty tenant/model = any; ``types`` None
    or empty = every type)."""
    if tenant and change.tenant != tenant:
        return False
    if model and change.model != model:
        return False
    return not types or change.type in types
