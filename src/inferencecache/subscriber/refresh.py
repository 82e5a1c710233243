"""Keeping a live engine's resident blocks from ageing out of the index (docs/subscriber.md).

A hold ages from its last ingest, and an engine never re-stores a block that stays resident (a
prefix-cache hit publishes nothing), so without help the hottest blocks of all (shared system
prompts, block 0 of most chains) expire after the server's TTL while every engine still holds
them. The subscriber knows the resident set (the mapper's reverse map), so it re-reports it:

* :class:`RefreshPacer` walks a snapshot of the resident blocks once per ``interval``, evenly
  over time (the share of the cycle that has elapsed, in slices of at least ``min_batch``
  blocks, never more often than every ``min_tick`` seconds), and re-reads every block from the
  mapper as it goes, so a block evicted since the snapshot is never refreshed. The entries go
  into the forwarder's pending adds (``Outbox.refresh``): the same ordered queue as the engine's
  events, so an eviction enqueued after a refresh is applied after it, and a busy engine's
  refresh rides along in updates that were going out anyway. The wire stays plain v1alpha1:
  legacy entries of a ``ReportCacheState`` at ``timestamp_us`` 0 ("now" at the server).
* :class:`EngineLiveness` says whether the engine is alive; while it is not, the pacer pauses
  (and resumes where it was, without a burst), so a dead or silent engine's holds still expire
  by the TTL. A subscriber that dies stops refreshing by itself.

Neither class reads a clock: callers pass ``now`` (seconds, monotonic), so the simulator runs
this very code in simulated time (``sim/simulator.py``) and tests drive it step by step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Final, Protocol

log = logging.getLogger("inferencecache.subscriber")

DEFAULT_INTERVAL: Final = 600.0
"""A full refresh cycle: the server's default TTL (30 min) / 3. A block is re-reported at most
about two cycles after its previous report (see :class:`RefreshPacer`), so 10 min keeps every
resident block well inside the default TTL."""
MIN_BATCH: Final = 1024
"""Blocks per refresh slice when the cycle allows it. An idle engine's slice is one
``ReportCacheState`` stream of its own, and a stream costs the server ~1.2 ms of CPU whatever its
size against ~0.6 µs per entry (bench/refresh.py): at 20k resident blocks and the default cycle
this is one ~10 KB update every ~30 s per engine, ~0.5% of one server core for 100 engines
(256-entry slices measured 1.7-2.7%). A busy engine's slices ride along with its own adds."""
MIN_TICK: Final = 1.0
"""Never tick more often than this (seconds)."""
PAUSED_RECHECK: Final = 1.0
"""While the engine is not alive, look again this often (seconds)."""
LIVENESS_PROBES: Final = 3
"""An engine whose HTTP probes used to answer is dead after this many probe intervals of silence
(no answer and no event), like the stats path's ``load_signal_stale`` threshold."""


class ResidentSource(Protocol):
    """What the pacer reads: the mapper (``BlockMapper``)."""

    def resident(self) -> list[tuple[int, list[bytes]]]:
        """Engine hashes of every resident block, per group."""

    def refresh(self, group: int, keys: Sequence[bytes]) -> int:
        """Re-report the blocks of ``keys`` that are still resident; returns how many."""


class RefreshPacer:
    """Which resident blocks to re-report now, so each is re-reported once per ``interval``.

    A cycle starts with a snapshot of the resident engine hashes (a list copy per group) and
    emits the prefix of it that is proportional to the time elapsed in the cycle; the next cycle
    starts when the whole snapshot has been emitted and ``interval`` has passed (an empty
    snapshot is retaken every ``min_tick`` until blocks appear). Blocks stored during a cycle
    were just reported; they join the next snapshot, so a block waits at most about
    ``2 * interval`` (plus one tick) between two reports, ~20 min at the default.
    """

    def __init__(
        self, interval: float, *, min_batch: int = MIN_BATCH, min_tick: float = MIN_TICK
    ) -> None:
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError(f"refresh interval must be a positive number, got {interval}")
        self.interval = interval
        self.min_batch = max(1, min_batch)
        self.min_tick = max(0.0, min_tick)
        self.cycles = 0  # completed cycles
        self.emitted = 0  # entries handed to the outbox, all cycles
        self._snapshot: list[tuple[int, list[bytes]]] = []
        self._total = 0
        self._pos = 0  # blocks of the snapshot consumed
        self._group = 0  # cursor: index into _snapshot, offset into its keys
        self._offset = 0
        self._start: float | None = None
        self._last: float | None = None

    @property
    def position(self) -> tuple[int, int]:
        """(blocks consumed, snapshot size) of the current cycle."""
        return self._pos, self._total

    def _begin(self, now: float, source: ResidentSource) -> None:
        self._snapshot = source.resident()
        self._total = sum(len(keys) for _, keys in self._snapshot)
        self._pos = self._group = self._offset = 0
        self._start = now

    def _target(self, now: float) -> int:
        assert self._start is not None
        elapsed = now - self._start
        if elapsed >= self.interval:
            return self._total
        return min(self._total, math.ceil(self._total * elapsed / self.interval))

    def tick(self, now: float, source: ResidentSource, alive: bool = True) -> int:
        """Emit what is due at ``now``; returns the entries re-reported.

        While ``alive`` is false nothing is emitted and the cycle is shifted by the time that
        passed, so it resumes where it stopped instead of catching up in one burst."""
        if self._start is None:
            self._begin(now, source)
        assert self._start is not None
        last = self._last if self._last is not None else now
        self._last = now
        if not alive:
            self._start += max(0.0, now - last)
            return 0
        target = self._target(now)
        sent = 0
        if target - self._pos >= self.min_batch or (target == self._total > self._pos):
            sent = self._emit(target - self._pos, source)
        if self._pos >= self._total and (now - self._start >= self.interval or not self._total):
            # the cycle is done (an empty one at once: the first blocks start the next one)
            if self._total:
                self.cycles += 1
            self._begin(now, source)
        return sent

    def _emit(self, n: int, source: ResidentSource) -> int:
        sent = 0
        snap = self._snapshot
        while n > 0 and self._group < len(snap):
            group, keys = snap[self._group]
            take = keys[self._offset : self._offset + n]
            self._offset += len(take)
            self._pos += len(take)
            n -= len(take)
            if take:
                sent += source.refresh(group, take)
            if self._offset >= len(keys):
                self._group += 1
                self._offset = 0
        self.emitted += sent
        return sent

    def next_due(self, now: float) -> float:
        """When :meth:`tick` has something to do next (never sooner than ``min_tick``)."""
        if self._start is None:
            return now
        if not self._total:
            return now + self.min_tick  # nothing resident yet: look again soon
        end = self._start + self.interval
        if self._pos < self._total:
            due = self._start + (self._pos + self.min_batch) * self.interval / self._total
            due = min(due, end)
        else:
            due = end
        return max(due, now + self.min_tick)


class EngineLiveness:
    """Whether the engine behind the subscriber is alive, from what the subscriber observes.

    * ``connected`` (the SUB socket's monitor, when given): not connected means not alive. An
      engine that stops or crashes closes the socket, which the intake also turns into a clear.
    * Once an HTTP probe of the engine (the stats scrape, the adapter poll) has answered, the
      engine must keep proving it is alive: an answer or an engine event within ``window``
      seconds. This covers what the socket cannot see: a frozen engine, or a host gone without
      closing the connection.
    * Before any probe has answered (none configured, or a wrong URL), the connection alone
      decides, so a misconfigured probe cannot make a live engine's holds expire.
    """

    def __init__(
        self,
        window: float,
        *,
        connected: Callable[[], bool] | None = None,
        last_event: Callable[[], float | None] | None = None,
    ) -> None:
        self.window = window
        self._connected = connected
        self._last_event = last_event
        self._last_probe: float | None = None

    def probe_ok(self, now: float) -> None:
        """An HTTP probe of the engine answered at ``now``."""
        self._last_probe = now

    def alive(self, now: float) -> bool:
        if self._connected is not None and not self._connected():
            return False
        probe = self._last_probe
        if probe is None:
            return True
        last = probe
        if self._last_event is not None:
            ev = self._last_event()
            if ev is not None and ev > last:
                last = ev
        return now - last <= self.window


def refresh_step(
    pacer: RefreshPacer, source: ResidentSource, liveness: EngineLiveness, now: float
) -> tuple[bool, float]:
    """One step of the refresher at ``now``: (engine alive, when to step next). The subscriber's
    task and the simulator both step through here."""
    alive = liveness.alive(now)
    pacer.tick(now, source, alive)
    return alive, (pacer.next_due(now) if alive else now + PAUSED_RECHECK)


async def run_refresher(
    pacer: RefreshPacer,
    source: ResidentSource,
    liveness: EngineLiveness,
    *,
    on_pause: Callable[[bool], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """The subscriber's refresh task: tick the pacer when it is due, until cancelled.

    ``on_pause(paused)`` is told each time the engine's liveness flips (logs, a gauge)."""
    paused: bool | None = None
    while True:
        alive, due = refresh_step(pacer, source, liveness, clock())
        if paused is None or paused == alive:  # first look, or the engine's state flipped
            paused = not alive
            if on_pause is not None:
                on_pause(paused)
        await asyncio.sleep(max(0.0, due - clock()))
