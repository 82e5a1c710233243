"""Housekeeping of an appending replica: tick entries for a quiet log, and trimming.

Ticks: the log clock moves only with entries, and the TTL sweep runs on the log clock, so when
nothing was appended for a sweep interval this thread appends an empty tick (several replicas
may each append one: only the first moves the sweep). Trimming: every minute, ``XTRIM MINID``
at ``retention`` before Redis's clock (docs/event-log.md, "Retention"); any replica may trim,
concurrent trims are harmless.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from inferencecache.eventlog import codec
from inferencecache.eventlog.appender import Appender
from inferencecache.eventlog.redislog import LogUnavailable

log = logging.getLogger("inferencecache.eventlog")

TRIM_EVERY: Final = 60.0


class Upkeep:
    def __init__(
        self,
        appender: Appender,
        log_clock_us: Callable[[], int],
        *,
        sweep_interval: float,
        retention: Callable[[], float],
        trim_every: float = TRIM_EVERY,
    ) -> None:
        self.appender = appender
        self._log_clock_us = log_clock_us
        self.sweep_interval = sweep_interval
        self.retention = retention
        self.trim_every = trim_every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eventlog-upkeep", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _run(self) -> None:
        period = max(0.05, min(self.sweep_interval / 2, self.trim_every))
        next_trim = time.monotonic() + min(self.trim_every, 5.0)
        while not self._stop.wait(period):
            now_us = time.time_ns() // 1000
            if now_us - self._log_clock_us() >= self.sweep_interval * 1_000_000:
                with contextlib.suppress(LogUnavailable):
                    self.appender.submit(codec.KIND_TICK, b"")
            if time.monotonic() >= next_trim:
                next_trim = time.monotonic() + self.trim_every
                try:
                    retention = self.retention()
                    deleted = self.appender.trim(retention)
                except Exception as e:
                    log.warning("event log trim failed", extra={"err": f"{type(e).__name__}: {e}"})
                    continue
                if deleted:
                    log.info("event log trimmed", extra={"entries": deleted,
                                                         "retention_s": retention})
