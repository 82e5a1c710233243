"""Batching and the one ordered sender of RPCs (engine-events-and-subscriber.md §3.5, §3.7).

The mapper calls the :class:`Forwarder` synchronously (it implements ``mapping.Outbox``); nothing
here ever blocks the caller. Adds wait in a pending buffer flushed every window, at 4096 entries,
before any removal and at shutdown; each flush becomes one ``CacheStateUpdate`` (≤ 4096 entries)
on a fresh ``ReportCacheState`` stream. A single sender task delivers updates and events in order
(an eviction never overtakes the add it undoes), each with a 5 s deadline; a run of add flushes
and evictions that commute is sent as updates then the evictions concurrently (``_pop_run``).
When the sender is behind, the updates of a run (each still ≤ 4096 entries, in order) share one
stream, up to ``MAX_STREAM_UPDATES``: a stream costs ~0.5-1 ms of CPU on each side.

With ``batch_evictions`` (the default; ``--batch-evictions``) evictions go out batched: one
``PublishEvent`` carries ``prefix_hash`` and further hashes in ``prefix_hashes`` (field 8, an
additive contract field) for every eviction of a run that shares its adapter and timestamp, i.e.
at least every eviction of one BlockRemoved event and usually of a whole engine batch. A batch
is sent as one message only to a server whose reflected contract has that field (asked once per
connection, ``CacheClient.supports_batched_evictions``); to any other server it goes out as one
``PublishEvent`` per hash, as an older server would apply only ``prefix_hash``.
``batch_evictions=False`` always sends exactly one ``PublishEvent`` per evicted block.

When an RPC fails the sender backs off (100 ms doubling to 1 s) and marks a resync: adds made
meanwhile are counted and dropped instead of queued (the resync re-sends the whole resident state,
so retrying them one by one would only delay it); evictions and clears stay queued (bounded) because
the server may still hold those blocks. The next attempt is the resync itself
(engine-events-and-subscriber.md §3.7): queued removals first, or one ``ALL_CLEARED`` if a removal
was lost, then every resident block at ``timestamp_us`` 0. A connectivity watcher (``resync.py``)
requests the same resync when the channel comes back after a loss, which covers a server restart
while the engine is quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import countOf, itemgetter
from typing import Final

from inferencecache.subscriber.client import CacheClient, describe_error
from inferencecache.subscriber.mapping import Block
from inferencecache.subscriber.messages import (
    ALL_CLEARED,
    PREFIX_EVICTED,
    Entry,
    Identity,
    UpdateEncoder,
    build_event,
)
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.tiers import T1, best_tier

log = logging.getLogger("inferencecache.subscriber")

MAX_PENDING: Final = 4096  # entries per update; a full buffer flushes at once
MAX_QUEUED_ENTRIES: Final = 131072  # adds waiting for the sender before they are dropped
MAX_QUEUED_EVENTS: Final = 65536  # evictions/clears waiting for the sender
# Consecutive PREFIX_EVICTED events go out concurrently, up to this many at a time: evictions of
# different prefixes commute, so only their order relative to adds and clears matters, and one
# unary RPC at a time caps eviction-heavy traffic at about a thousand blocks per second.
EVICTION_FANOUT: Final = 128
MAX_EVICTION_BATCH: Final = 4096  # hashes per batched PublishEvent (~40 KB on the wire)
# Updates (each <= max_pending entries) sent on one ReportCacheState stream when the sender is
# behind: the server applies them in order, and the ~0.5-1 ms of CPU per stream on each side is
# paid once instead of per 4096 entries.
MAX_STREAM_UPDATES: Final = 16
BACKOFF_MIN: Final = 0.1
BACKOFF_MAX: Final = 1.0

SnapshotFn = Callable[[], list[list[Block]]]


@dataclass(slots=True)
class _Report:
    entries: list[Entry]
    ts_us: int
    separate: bool = False  # a T2 re-report: always its own update, never merged


@dataclass(slots=True)
class _Event:
    kind: int
    ts_us: int
    prefix: bytes = b""
    adapter: str = ""
    more: list[bytes] | None = None  # a batched PREFIX_EVICTED: the hashes after ``prefix``

    @property
    def size(self) -> int:
        """Evicted blocks (or 1 for a clear)."""
        return 1 + len(self.more) if self.more else 1

    def hashes(self) -> list[bytes]:
        return [self.prefix, *self.more] if self.more else [self.prefix]


_Item = _Report | _Event


def _chunks(entries: list[Entry], size: int) -> list[list[Entry]]:
    if len(entries) <= size:
        return [entries]
    return [entries[i : i + size] for i in range(0, len(entries), size)]


_tier_of = itemgetter(3)


def _updates(reports: list[_Report], size: int) -> list[tuple[list[Entry], int]]:
    """A run's reports as updates of <= ``size`` entries, in order: consecutive reports merged
    (stamped with the last positive timestamp among them), a larger one split."""
    out: list[tuple[list[Entry], int]] = []
    cur: list[Entry] = []
    cur_ts = 0
    for r in reports:
        if cur and len(cur) + len(r.entries) > size:
            out.append((cur, cur_ts))
            cur, cur_ts = [], 0
        if len(r.entries) > size:
            out += [(chunk, r.ts_us) for chunk in _chunks(r.entries, size)]
            continue
        cur.extend(r.entries)  # a fresh list: the reports' own lists are never changed
        if r.ts_us > 0:
            cur_ts = r.ts_us
    if cur:
        out.append((cur, cur_ts))
    return out


def _batched(events: list[_Event]) -> list[_Event]:
    """Evictions of a run merged per (adapter, timestamp), hashes in order, bounded batches."""
    groups: dict[tuple[str, int], list[bytes]] = {}
    for e in events:
        hs = groups.setdefault((e.adapter, e.ts_us), [])
        hs.append(e.prefix)
        if e.more:
            hs += e.more
    out: list[_Event] = []
    for (adapter, ts), hs in groups.items():
        for i in range(0, len(hs), MAX_EVICTION_BATCH):
            part = hs[i : i + MAX_EVICTION_BATCH]
            out.append(_Event(PREFIX_EVICTED, ts, part[0], adapter, part[1:] or None))
    return out


def _batched_in_order(events: list[_Event]) -> list[_Event]:
    """``_batched`` over each run of consecutive evictions; clears stay where they are."""
    out: list[_Event] = []
    run: list[_Event] = []
    for e in events:
        if e.kind == PREFIX_EVICTED:
            run.append(e)
            continue
        out += _batched(run)
        run = []
        out.append(e)
    return out + _batched(run)


class Forwarder:
    """Pending adds, the ordered RPC queue, backoff and resync."""

    def __init__(
        self,
        client: CacheClient,
        ident: Identity,
        metrics: SubscriberMetrics,
        *,
        window: float,
        snapshot: SnapshotFn,
        max_pending: int = MAX_PENDING,
        max_queued_entries: int = MAX_QUEUED_ENTRIES,
        max_queued_events: int = MAX_QUEUED_EVENTS,
        batch_evictions: bool = True,
    ) -> None:
        self.client = client
        self.ident = ident
        self.metrics = metrics
        self.window = window
        self.batch_evictions = batch_evictions
        self._encoder = UpdateEncoder(ident)
        self._snapshot = snapshot
        self._max_pending = max_pending
        self._max_stream_entries = max_pending * MAX_STREAM_UPDATES
        self._max_queued_entries = max_queued_entries
        self._max_queued_events = max_queued_events
        self._pending: list[Entry] = []
        self._pending_ts = 0
        self._timer: asyncio.TimerHandle | None = None
        self._queue: deque[_Item] = deque()
        self._queued_entries = 0
        self._queued_events = 0
        self._wake = asyncio.Event()
        self._closing = False
        self._healthy = True
        self._backoff = BACKOFF_MIN
        self._retry_at = 0.0
        self._resync_pending = False
        self._removals_lost = False
        self._loop = asyncio.get_running_loop()

    # ---- Outbox (called synchronously by the mapper) ----------------------------------------

    def add_many(self, entries: list[Entry], ts_us: int) -> None:
        if self._resync_pending:
            self.metrics.adds_not_sent.inc(len(entries))
            return
        self._pend(entries, ts_us)

    def refresh(self, entries: list[Entry]) -> None:
        """Resident blocks re-reported by the refresher: pending adds at "now", so they ride
        along with the engine's own adds and keep their place in the one ordered queue (an
        eviction that follows is sent after them)."""
        if self._resync_pending:
            return  # the resync re-sends every resident block anyway
        self.metrics.refresh_entries.inc(len(entries))
        self._pend(entries, 0)

    def _pend(self, entries: list[Entry], ts_us: int) -> None:
        pending = self._pending
        pending.extend(entries)
        if ts_us > 0:
            self._pending_ts = ts_us
        if len(pending) >= self._max_pending:
            self.flush()
        elif self._timer is None:
            self._timer = self._loop.call_later(self.window, self._on_timer)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending = self._pending
        if not pending:
            return
        ts = self._pending_ts
        self._pending = []
        self._pending_ts = 0
        for chunk in _chunks(pending, self._max_pending):
            self._enqueue_report(chunk, ts)

    def report(self, entries: list[Entry], ts_us: int) -> None:
        for chunk in _chunks(entries, self._max_pending):
            self._enqueue_report(chunk, ts_us, separate=True)

    def evict(self, prefix: bytes, adapter: str, ts_us: int) -> None:
        if self.batch_evictions and self._queue:
            last = self._queue[-1]  # not sent yet: the sender pops before it sends
            if (
                type(last) is _Event
                and last.kind == PREFIX_EVICTED
                and last.adapter == adapter
                and last.ts_us == ts_us
                and last.size < MAX_EVICTION_BATCH
                and self._queued_events < self._max_queued_events
            ):
                if last.more is None:
                    last.more = [prefix]
                else:
                    last.more.append(prefix)
                self._queued_events += 1
                return
        self._enqueue_event(_Event(PREFIX_EVICTED, ts_us, prefix, adapter))

    def clear(self, ts_us: int) -> None:
        self._discard_pending()
        self._enqueue_event(_Event(ALL_CLEARED, ts_us))

    # ---- control ----------------------------------------------------------------------------

    def request_resync(self) -> None:
        """Re-send the whole resident state before the next live item (connectivity back)."""
        self._resync_pending = True
        self._wake.set()

    def close(self) -> None:
        """No more input: flush what is pending; :meth:`run` returns once the queue is done."""
        self.flush()
        self._closing = True
        self._wake.set()

    @property
    def queued(self) -> int:
        """Items waiting for the sender."""
        return len(self._queue)

    @property
    def pending(self) -> int:
        """Adds waiting for the window."""
        return len(self._pending)

    # ---- internals --------------------------------------------------------------------------

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()

    def _discard_pending(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending = []
        self._pending_ts = 0

    def _enqueue_report(self, entries: list[Entry], ts_us: int, separate: bool = False) -> None:
        n = len(entries)
        if self._resync_pending:
            self.metrics.adds_not_sent.inc(n)
            return
        if self._queued_entries + n > self._max_queued_entries:
            # The server is slower than the engine: drop, and let a resync catch up later.
            self.metrics.adds_not_sent.inc(n)
            if not self._resync_pending:
                log.warning(
                    "send queue full; dropping adds until the next resync",
                    extra={"queued_entries": self._queued_entries},
                )
            self._resync_pending = True
            return
        self._queued_entries += n
        self._queue.append(_Report(entries, ts_us, separate))
        self._wake.set()

    def _enqueue_event(self, event: _Event) -> None:
        if self._queued_events >= self._max_queued_events:
            self.metrics.events_not_sent.inc()
            self._removals_lost = True
            self._resync_pending = True
            return
        self._queued_events += event.size
        self._queue.append(event)
        self._wake.set()

    def _pop(self) -> _Item:
        item = self._queue.popleft()
        if isinstance(item, _Report):
            self._queued_entries -= len(item.entries)
        else:
            self._queued_events -= item.size
        return item

    def _drop_queue(self, reason: str) -> None:
        lost_entries = lost_events = 0
        while self._queue:
            item = self._pop()
            if isinstance(item, _Report):
                lost_entries += len(item.entries)
            else:
                lost_events += item.size
        if lost_entries:
            self.metrics.adds_not_sent.inc(lost_entries)
        if lost_events:
            self.metrics.events_not_sent.inc(lost_events)
        if lost_entries or lost_events:
            log.warning(
                "dropping unsent reports",
                extra={"reason": reason, "prefixes": lost_entries, "events": lost_events},
            )

    def _succeeded(self) -> None:
        self._healthy = True
        self._backoff = BACKOFF_MIN

    def _failed(self) -> None:
        self._healthy = False
        self._retry_at = self._loop.time() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        self._resync_pending = True

    async def _send_reports(
        self, updates: list[tuple[list[Entry], int]], resync: bool = False
    ) -> bool:
        """Updates on one ReportCacheState stream, in order (wire bytes, no protobuf objects)."""
        encode = self._encoder.encode
        n = sum(len(entries) for entries, _ in updates)
        try:
            await self.client.report_many([encode(entries, ts) for entries, ts in updates])
        except Exception as e:  # any transport or server error: drop, never raise
            self.metrics.rpc_failures["ReportCacheState"].inc()
            if not resync:
                self.metrics.adds_not_sent.inc(n)
            log.warning(
                "report send failed; dropping batch",
                extra={"err": describe_error(e), "prefixes": n},
            )
            self._failed()
            return False
        t1 = sum(countOf(map(_tier_of, entries), T1) for entries, _ in updates)
        if t1:
            self.metrics.prefixes_reported["T1"].inc(t1)
        if n - t1:
            self.metrics.prefixes_reported["T2"].inc(n - t1)
        self._succeeded()
        return True

    async def _publish(self, event: _Event) -> bool:
        """One PublishEvent (one per hash when the server cannot take a batch); logs and counts
        a failure but leaves the backoff to the caller."""
        try:
            if event.more and not await self.client.supports_batched_evictions():
                hashes = [event.prefix, *event.more]
                await asyncio.gather(*(
                    self.client.publish(build_event(self.ident, event.kind, event.ts_us, h,
                                                    event.adapter, ()))
                    for h in hashes
                ))
            else:
                await self.client.publish(build_event(
                    self.ident, event.kind, event.ts_us, event.prefix, event.adapter,
                    event.more or ()))
        except Exception as e:
            name = "PREFIX_EVICTED" if event.kind == PREFIX_EVICTED else "ALL_CLEARED"
            self.metrics.rpc_failures["PublishEvent"].inc()
            self.metrics.events_not_sent.inc(event.size)
            self._removals_lost = True
            log.warning(
                "publish event failed; dropping",
                extra={"type": name, "err": describe_error(e), "prefixes": event.size},
            )
            return False
        if event.kind == PREFIX_EVICTED:
            self.metrics.evictions.inc(event.size)
        else:
            self.metrics.all_cleared.inc()
        return True

    async def _send_event(self, event: _Event) -> bool:
        ok = await self._publish(event)
        if ok:
            self._succeeded()
        else:
            self._failed()
        return ok

    async def _send_evictions(self, events: list[_Event]) -> bool:
        if self.batch_evictions:
            events = _batched(events)
        if len(events) == 1:
            return await self._send_event(events[0])
        results = await asyncio.gather(*(self._publish(e) for e in events))
        if all(results):
            self._succeeded()
            return True
        self._failed()
        return False

    def _pop_run(self, first: _Report | _Event) -> tuple[list[_Report], list[_Event]]:
        """``first`` and the add flushes / evictions queued behind it that may be reordered to
        "adds first, then evictions" without changing the server's final state.

        The spec's order is one flush of pending adds before each removal, so an engine that
        evicts one block per stored block (a full cache) costs two round trips per block. Adds
        and evictions of different prefixes commute, so a run of them is sent as updates on one
        stream followed by the evictions concurrently; the run stops before an add of a prefix
        already evicted in it (a re-store must follow its eviction), before a T2 re-report
        (always its own update) and before a clear.
        """
        reports: list[_Report] = []
        evictions: list[_Event] = []
        evicted_all: set[bytes] = set()  # prefixes evicted for every adapter ("")
        evicted: set[tuple[bytes, str]] = set()
        entries = 0

        def take(item: _Report | _Event) -> None:
            nonlocal entries
            if isinstance(item, _Report):
                reports.append(item)
                entries += len(item.entries)
            else:
                evictions.append(item)
                if item.adapter:
                    evicted.update((h, item.adapter) for h in item.hashes())
                else:
                    evicted_all.update(item.hashes())

        take(first)
        queue = self._queue
        while queue:
            nxt = queue[0]
            if isinstance(nxt, _Report):
                if nxt.separate or entries + len(nxt.entries) > self._max_stream_entries:
                    break
                if evictions and any(
                    e[0] in evicted_all or (e[0], e[2]) in evicted for e in nxt.entries
                ):
                    break
            elif nxt.kind != PREFIX_EVICTED or len(evictions) >= EVICTION_FANOUT:
                break
            take(self._pop())
        return reports, evictions

    async def _send(self, item: _Item) -> bool:
        if isinstance(item, _Report) and item.separate:
            return await self._send_reports([(item.entries, item.ts_us)])
        if isinstance(item, _Event) and item.kind != PREFIX_EVICTED:
            return await self._send_event(item)
        reports, evictions = self._pop_run(item)
        if reports and not await self._send_reports(_updates(reports, self._max_pending)):
            if evictions:  # not attempted: covered by the resync's clear
                self.metrics.events_not_sent.inc(sum(e.size for e in evictions))
                self._removals_lost = True
            return False
        if evictions:
            return await self._send_evictions(evictions)
        return True

    async def _resync(self) -> None:
        """Queued removals (or one ALL_CLEARED), then every resident block at "now"."""
        self._resync_pending = False
        removals: list[_Event] = []
        while self._queue:
            item = self._pop()
            if isinstance(item, _Event):
                removals.append(item)
        self._discard_pending()  # covered by the snapshot
        lost = self._removals_lost
        self._removals_lost = False
        steps: list[_Event] = [_Event(ALL_CLEARED, 0)] if lost else removals
        groups = self._snapshot()
        total = sum(len(g) for g in groups)
        if not steps and not total:
            self._healthy = True
            return
        if self.batch_evictions and not lost:
            steps = _batched_in_order(steps)
        for i, step in enumerate(steps):
            if not await self._send_event(step):
                if i + 1 < len(steps):
                    self.metrics.events_not_sent.inc(sum(e.size for e in steps[i + 1 :]))
                return
        sent = 0
        size = self._max_pending
        stream = size * MAX_STREAM_UPDATES
        for blocks in groups:
            for start in range(0, len(blocks), stream):
                part = [(b[0], b[1], b[2], best_tier(b[3])) for b in blocks[start : start + stream]]
                if not await self._send_reports([(c, 0) for c in _chunks(part, size)],
                                                 resync=True):
                    self.metrics.resync_entries.inc(sent)
                    return
                sent += len(part)
        self.metrics.resync_entries.inc(sent)
        self.metrics.resyncs.inc()
        log.info(
            "resynced resident blocks to the server",
            extra={"prefixes": sent, "cleared_first": lost, "removals": len(removals)},
        )

    async def _wait(self, delay: float | None) -> None:
        self._wake.clear()
        if delay is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)

    async def run(self) -> None:
        """The sender: deliver items in order until closed and drained."""
        while True:
            if not self._queue and not self._resync_pending:
                if self._closing:
                    return
                await self._wait(None)
                continue
            if not self._healthy:
                if self._closing:
                    self._drop_queue("shutdown while the server is failing")
                    return
                delay = self._retry_at - self._loop.time()
                if delay > 0:
                    await self._wait(delay)
                    continue
                self._resync_pending = True
            if self._resync_pending and not self._closing:
                await self._resync()
                continue
            if not self._queue:
                self._resync_pending = False
                continue
            await self._send(self._pop())

