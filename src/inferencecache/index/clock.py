"""Time sources of the index, injected so tests drive ages and deadlines without sleeping.

Two clocks on purpose: hold ages use the UTC wall clock in integer microseconds (ingest stamps
``last_seen`` with it and updates may carry their own ``timestamp_us``), while deadlines use a
monotonic clock in float seconds (a wall-clock step must never fire or extend a deadline).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from concurrent.futures import Future
from typing import Any, Protocol


class Clock(Protocol):
    def now_us(self) -> int:
        """UTC wall clock, integer microseconds since the Unix epoch."""
        ...

    def monotonic(self) -> float:
        """Monotonic seconds (deadlines and latency)."""
        ...

    def wait(self, future: Future[Any], timeout: float) -> bool:
        """Block until ``future`` is done or ``timeout`` seconds of this clock have passed.

        Returns whether the future is done. Used for the tokenizer wait of a lookup.
        """
        ...


class SystemClock:
    """The real clocks."""

    __slots__ = ()

    def now_us(self) -> int:
        return time.time_ns() // 1000

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, future: Future[Any], timeout: float) -> bool:
        done, _ = concurrent.futures.wait([future], timeout=max(0.0, timeout))
        return bool(done)


class FakeClock:
    """A manually advanced clock for tests (thread-safe).

    ``advance`` moves both clocks. ``wait`` polls: it returns as soon as the future completes
    (really) or this clock's monotonic time has passed the timeout (someone advanced it), so a
    test can model a hung worker by advancing the clock from inside it.
    """

    def __init__(self, now_us: int = 1_700_000_000_000_000, monotonic: float = 1000.0) -> None:
        self._lock = threading.Lock()
        self._now_us = now_us
        self._mono = monotonic

    def now_us(self) -> int:
        with self._lock:
            return self._now_us

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now_us += round(seconds * 1_000_000)
            self._mono += seconds

    def set_now_us(self, now_us: int) -> None:
        with self._lock:
            self._now_us = now_us

    def wait(self, future: Future[Any], timeout: float) -> bool:
        end = self.monotonic() + timeout
        while True:
            if future.done():
                return True
            if self.monotonic() >= end:
                return False
            concurrent.futures.wait([future], timeout=0.001)
