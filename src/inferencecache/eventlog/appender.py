"""Appending accepted ingest to the log, with group commit.

Many RPC threads hand items in at once; one appender thread writes whatever is queued as one
entry per round trip (up to ``max_entry_bytes``), so under load entries grow instead of round
trips multiplying, and an idle server pays one round trip per item. A caller gets a
``concurrent.futures.Future`` per ``submit`` (an asyncio server can ``asyncio.wrap_future``
it) that completes when its entry is in Redis, or fails with ``LogUnavailable``.

When Redis fails, every queued item fails at once and the log is marked down: further submits
fail immediately (the ingest RPC answers UNAVAILABLE and the subscriber keeps and resends its
state) until a probe succeeds; probes back off from 0.1 s to 5 s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final

from inferencecache.eventlog import codec
from inferencecache.eventlog.metrics import EventLogMetrics
from inferencecache.eventlog.redislog import APPEND_SCRIPT, TRIM_SCRIPT, LogUnavailable, RedisLog

log = logging.getLogger("inferencecache.eventlog")

MAX_ENTRY_BYTES: Final = 1 << 20
"""An entry holds at most this many payload bytes (one larger item is an entry of its own)."""
BACKOFF_MIN: Final = 0.1
BACKOFF_MAX: Final = 5.0
_LOG_EVERY: Final = 10.0


def appender_id() -> str:
    """``host/pid``: names the writer of an entry in logs; never used to apply it."""
    return f"{socket.gethostname()}/{os.getpid()}"


class Appender:
    """Group-committing writer of one log (thread-safe ``submit``)."""

    def __init__(
        self,
        log_: RedisLog,
        metrics: EventLogMetrics,
        *,
        clock_us: Callable[[], int] = lambda: time.time_ns() // 1000,
        ident: str | None = None,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        self.log = log_
        self.metrics = metrics
        self.ident = ident or appender_id()
        self._clock_us = clock_us
        self._max_bytes = max_entry_bytes
        self._client = log_.client()
        self._append = self._client.register_script(APPEND_SCRIPT)
        self._trim = self._client.register_script(TRIM_SCRIPT)
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, bytes, Future[None]]] = deque()
        self._up = True  # optimistic until the first failure
        self._closed = False
        self._last_log = -_LOG_EVERY
        self._thread = threading.Thread(target=self._run, name="eventlog-append", daemon=True)
        self._up_gauge = metrics.log_up("append")
        self._up_gauge.set(1)

    # -- API --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def up(self) -> bool:
        return self._up

    def submit(self, kind: int, payload: bytes) -> Future[None]:
        """Queue one item; raises ``LogUnavailable`` at once while the log is down."""
        fut: Future[None] = Future()
        with self._cond:
            if self._closed or not self._up:
                self.metrics.append_rejected.inc()
                raise LogUnavailable("event log unavailable")
            self._queue.append((kind, payload, fut))
            self._cond.notify()
        return fut

    def trim(self, retention_s: float) -> int:
        """Delete entries older than ``retention_s`` by Redis's clock (any replica may call it;
        concurrent trims are harmless). Raises redis errors to the caller."""
        deleted: Any = self._trim(keys=[self.log.keys.log], args=[int(retention_s * 1000)])
        return int(deleted)

    def close(self, timeout: float = 5.0) -> None:
        """Fail what is still queued after ``timeout`` and stop the thread."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._queue and time.monotonic() < end and self._up:
                self._cond.wait(0.05)
            self._closed = True
            self._fail_queued_locked()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._client.close()

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        backoff = BACKOFF_MIN
        while True:
            with self._cond:
                while not self._closed and (self._up and not self._queue):
                    self._cond.wait()
                if self._closed:
                    return
                batch = None if not self._up else self._take_locked()
            if batch is None:  # down: probe with backoff
                if self._probe():
                    backoff = BACKOFF_MIN
                    with self._cond:
                        self._up = True
                    self._up_gauge.set(1)
                    log.info("event log reachable again; accepting ingest",
                             extra={"log": self.log.describe()})
                else:
                    with self._cond:
                        if not self._closed:
                            self._cond.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            self._write(batch)

    def _take_locked(self) -> list[tuple[int, bytes, Future[None]]]:
        batch = [self._queue.popleft()]
        size = len(batch[0][1])
        while self._queue and size + len(self._queue[0][1]) <= self._max_bytes:
            item = self._queue.popleft()
            size += len(item[1])
            batch.append(item)
        return batch

    def _write(self, batch: list[tuple[int, bytes, Future[None]]]) -> None:
        entry = codec.encode(self._clock_us(), self.ident, ((k, p) for k, p, _ in batch))
        policy = b""
        for kind, payload, _ in batch:
            if kind == codec.KIND_POLICY:
                policy = payload
        t0 = time.perf_counter()
        try:
            keys = self.log.keys
            self._append(
                keys=[keys.log, keys.seq, keys.policy],
                args=[entry, "1" if policy else "0", policy],
            )
        except Exception as e:  # redis errors of every kind: the entry may or may not be there
            self.metrics.append_errors.inc()
            self.metrics.reconnects("append").inc()
            self._up_gauge.set(0)
            now = time.monotonic()
            if now - self._last_log >= _LOG_EVERY:
                self._last_log = now
                log.warning("event log append failed; ingest answers UNAVAILABLE until it is back",
                            extra={"err": f"{type(e).__name__}: {e}", "log": self.log.describe(),
                                   "every_s": _LOG_EVERY})
            err = LogUnavailable(f"event log unavailable: {type(e).__name__}")
            for _, _, fut in batch:
                fut.set_exception(err)
            with self._cond:
                self._up = False
                self._fail_queued_locked()
            return
        self.metrics.append_latency.observe(time.perf_counter() - t0)
        self.metrics.append_entries.inc()
        for kind, _, fut in batch:
            self.metrics.append_items(codec.KINDS.get(kind, "unknown")).inc()
            fut.set_result(None)

    def _fail_queued_locked(self) -> None:
        if not self._queue:
            return
        err = LogUnavailable("event log unavailable")
        while self._queue:
            self._queue.popleft()[2].set_exception(err)

    def _probe(self) -> bool:
        try:
            self._client.ping()
        except Exception:
            self.metrics.reconnects("append").inc()
            return False
        return True
