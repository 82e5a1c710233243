"""A replica's consumer: reads the log in order and applies every entry to its index.

One thread per replica. It starts from the newest valid snapshot (or empty), then reads the
stream from the position the state covers, in batches (``XREAD``), and applies each entry with
the ``Applier``. Every entry carries its sequence number, so the thread knows exactly what it
may have missed:

- the next entry has a larger number than expected: entries were trimmed before this replica
  read them (it was stopped or behind longer than the retention). Counted as a gap
  (``reason="trimmed"``); the replica rebuilds from the oldest entry still there (plus the
  newest policy, kept beside the stream) — a *fresh replay*.
- a smaller number, or the log's counter below the replica's position: the log went back
  (Redis lost acknowledged writes, or was emptied). Counted (``reason="rewound"``); fresh replay
  from the start of what the log has.

Redis down: lookups go on from memory; the thread retries with backoff (0.1 s doubling to 5 s)
and resumes from its position: an entry is applied once, because the position only moves past
an entry after it was applied and the read starts after the position. A bad entry (not
decodable) is counted, logged (rate-limited) and skipped; the loop itself never stops on one
input. The thread writes a snapshot every ``snapshot_interval`` when asked to (one writer per
directory) and reports readiness: caught up to within ``max_lag`` seconds of the log head.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final

from inferencecache.eventlog import codec
from inferencecache.eventlog.applier import Applier, LogTime
from inferencecache.eventlog.metrics import EventLogMetrics
from inferencecache.eventlog.redislog import RedisLog
from inferencecache.eventlog.snapshot import Position, SnapshotStore
from inferencecache.index.facade import Index
from inferencecache.index.persist import PersistError

log = logging.getLogger("inferencecache.eventlog")

READ_COUNT: Final = 256
BLOCK_MS: Final = 500
BACKOFF_MIN: Final = 0.1
BACKOFF_MAX: Final = 5.0
_LOG_EVERY: Final = 10.0


class _Every:
    """At most one log line per key every ``_LOG_EVERY`` seconds."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, key: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -_LOG_EVERY) < _LOG_EVERY:
            return False
        self._last[key] = now
        return True


class Follower:
    """Keeps one ``Index`` equal to the log (see the module doc)."""

    def __init__(
        self,
        index: Index,
        log_: RedisLog,
        metrics: EventLogMetrics,
        *,
        applier: Applier | None = None,
        snapshots: SnapshotStore | None = None,
        write_snapshots: bool = True,
        snapshot_interval: float = 300.0,
        max_lag: float = 2.0,
        read_count: int = READ_COUNT,
        block_ms: int = BLOCK_MS,
        wall_s: Callable[[], float] = time.time,
        settings_doc: bytes | None = None,
        publish_settings: bool = False,
    ) -> None:
        self.index = index
        self.log = log_
        self.metrics = metrics
        self.applier = applier if applier is not None else Applier(index, metrics)
        self.snapshots = snapshots
        self.write_snapshots = write_snapshots and snapshots is not None
        self.snapshot_interval = snapshot_interval
        self.max_lag = max_lag
        self.read_count = read_count
        self.block_ms = block_ms
        self._wall = wall_s
        self._settings_doc = settings_doc
        self._publish_settings = publish_settings
        self._client = log_.client(read_timeout=log_.socket_timeout + block_ms / 1000.0)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._started = threading.Event()
        self._cond = threading.Condition()
        self.position = Position()
        self._anchor = b""  # stream id of the last numbered entry read (position may be past it)
        self.head = 0  # the log's newest sequence number, as of the last read
        self.applied_wall_s = 0.0  # wall time (stream id) of the last applied entry
        self._last_snapshot = time.monotonic()
        self._snapshot_pos = Position()
        self._writer: threading.Thread | None = None
        self._every = _Every()
        self._thread = threading.Thread(target=self._run, name="eventlog-follow", daemon=True)
        self._up = metrics.log_up("follow")

    # -- API --------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the newest valid snapshot (in this thread: start-up waits for it), then follow
        the log in the background."""
        self._load_newest_snapshot()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._writer is not None:
            self._writer.join(timeout)
        self._client.close()

    @property
    def alive(self) -> bool:
        """The follower thread runs (False before ``start`` and after it ended)."""
        return self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """Caught up to within ``max_lag`` of the log head (stays set while Redis is down:
        the replica answers from memory, which is the point)."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def wait_for(self, seq: int, timeout: float) -> bool:
        """Block until entry ``seq`` has been applied (tests, benchmarks)."""
        end = time.monotonic() + timeout
        with self._cond:
            while self.position.seq < seq:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def lag(self) -> tuple[int, float]:
        """(entries, seconds) behind the head as of the last read."""
        entries = max(0, self.head - self.position.seq)
        if entries == 0:
            return 0, 0.0
        return entries, max(0.0, self._wall() - self.applied_wall_s)

    def snapshot_now(self) -> str | None:
        """Write a snapshot of the current state synchronously (tests); returns its path."""
        if self.snapshots is None:
            return None
        with self._cond:
            cap = self.index.capture_state()
            pos, t = self.position, _copy_time(self.applier)
        path, _ = self.snapshots.write(pos, t, cap.blobs())
        return path

    # -- start-up ---------------------------------------------------------------------------

    def _load_newest_snapshot(self) -> None:
        if self.snapshots is None:
            self.applier.reset()
            return
        for snap in self.snapshots.newest_first():
            t0 = time.perf_counter()
            try:
                self.index.replace_state(snap.blobs)
            except PersistError as e:
                log.warning("snapshot skipped", extra={"path": snap.path, "err": str(e)})
                self.metrics.snapshot_skipped.inc()
                continue
            self.applier.reset(snap.time)
            self.position = snap.position
            self._anchor = snap.position.stream_id
            self._snapshot_pos = snap.position
            self.metrics.snapshot_skipped.inc(self.snapshots.skipped)  # newer corrupt files
            self.applied_wall_s = snap.position.id_ms / 1000.0
            self.metrics.recoveries("snapshot").inc()
            self.metrics.snapshot_time.set(snap.written_us / 1e6)
            self.metrics.position.set(snap.position.seq)
            log.info("loaded snapshot", extra={
                "path": snap.path, "sequence": snap.position.seq,
                "seconds": round(time.perf_counter() - t0, 3),
                "holds": self.index.counts()["holds"]})
            return
        self.metrics.snapshot_skipped.inc(self.snapshots.skipped)
        self.applier.reset()

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = BACKOFF_MIN
        while not self._stop.is_set():
            try:
                self._read_once()
            except Exception as e:
                if _is_redis_error(e):
                    self._up.set(0)
                    self.metrics.reconnects("follow").inc()
                    if self._every("redis"):
                        log.warning("event log read failed; answering from memory, retrying",
                                    extra={"err": f"{type(e).__name__}: {e}",
                                           "log": self.log.describe(), "every_s": _LOG_EVERY})
                else:  # a bug: never let it stop the loop (dropped_inputs_total{loop="follow"})
                    self.metrics.drops.drop("follow", e, sequence=self.position.seq)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            backoff = BACKOFF_MIN
            self._up.set(1)
            if self._settings_doc is not None:
                self._check_settings(self._settings_doc)
                self._settings_doc = None
            self._maybe_snapshot()

    def _read_once(self) -> None:
        keys = self.log.keys
        pipe = self._client.pipeline(transaction=False)
        pipe.xread({keys.log: self.position.stream_id}, count=self.read_count,
                   block=self.block_ms)
        pipe.get(keys.seq)
        reply, head_raw = pipe.execute()
        head = int(head_raw or 0)
        entries: list[Any] = reply[0][1] if reply else []
        if head < self.position.seq:
            self._gap("rewound", f"the log's counter is {head}, this replica applied "
                      f"{self.position.seq}", head)
            self.head = head
            return
        self.head = head
        for stream_id, fields in entries:
            if self._stop.is_set():
                break
            try:
                seq = int(fields[b"n"])
                if seq <= 0:
                    raise ValueError(seq)
            except (KeyError, ValueError, TypeError):
                # not written by an appender of this format: skip it without using a number
                self.metrics.dropped("entry_no_sequence").inc()
                if self._every("no-sequence"):
                    log.warning("log entry without a sequence number skipped",
                                extra={"id": stream_id.decode(errors="replace")})
                with self._cond:
                    self.position = Position.of(self.position.seq, stream_id)
                continue
            expected = self.position.seq + 1
            if seq != expected:
                if seq > expected:
                    if expected == 1:  # nothing applied yet: start at the oldest entry kept
                        log.info("replaying the log from its oldest entry (older ones trimmed)",
                                 extra={"sequence": seq})
                    else:
                        self._gap("trimmed", f"next entry is {seq}, expected {expected}")
                    self._policy_before(seq)
                elif self.position.seq > 0 and self._position_intact():
                    # our own last entry is still there with its number: the log did not go
                    # back, so this number was written by someone else; skip the entry
                    self.metrics.dropped("entry_out_of_order").inc()
                    if self._every("out-of-order"):
                        log.warning("log entry numbered out of order skipped",
                                    extra={"id": stream_id.decode(errors="replace"),
                                           "sequence": seq, "expected": expected})
                    with self._cond:
                        self.position = Position.of(self.position.seq, stream_id)
                    continue
                else:
                    self._gap("rewound", f"next entry is {seq}, expected {expected}", seq - 1)
                    return
            data = fields.get(b"d")
            try:
                entry = codec.decode(data if isinstance(data, bytes) else b"")
            except codec.EntryError as e:
                self.metrics.dropped(f"entry_{e.reason}").inc()
                if self._every("bad-entry"):
                    log.warning("unreadable log entry skipped",
                                extra={"id": stream_id.decode(), "err": str(e)})
                entry = None
            with self._cond:
                if entry is not None:
                    self.applier.apply(entry)
                    self.metrics.applied_entries.inc()
                self.position = Position.of(seq, stream_id)
                self._anchor = stream_id
                self._cond.notify_all()
            self.applied_wall_s = self.position.id_ms / 1000.0
        self.metrics.position.set(self.position.seq)
        entries_lag, seconds_lag = self.lag()
        self.metrics.lag_entries.set(entries_lag)
        self.metrics.lag_seconds.set(seconds_lag)
        if not self._ready.is_set() and (entries_lag == 0 or seconds_lag <= self.max_lag):
            self._ready.set()
            self.metrics.ready.set(1)
            log.info("replica caught up", extra={"sequence": self.position.seq, "head": head})

    def _gap(self, reason: str, detail: str, kept: int | None = None) -> None:
        """Count the gap and start a fresh replay (the state is rebuilt from the log). After the
        log went back (``kept``: the last sequence number it still has), snapshots beyond it
        are deleted: they cover entries that no longer exist."""
        self.metrics.gaps(reason).inc()
        if kept is not None and self.write_snapshots and self.snapshots is not None:
            for path in self.snapshots.discard_after(kept):
                log.warning("snapshot deleted: the log went back before it", extra={"path": path})
        fresh = self.position.seq == 0 and self.index.counts()["keys"] == 0
        log.warning("event log gap; rebuilding this replica from the log",
                    extra={"reason": reason, "detail": detail, "log": self.log.describe(),
                           "fresh": fresh})
        with self._cond:
            if not fresh:
                self.index.replace_state(None)
            self.applier.reset()
            self.position = Position()
            self._anchor = b""
            self._cond.notify_all()
        self.metrics.recoveries("replay").inc()

    def _check_settings(self, mine: bytes) -> None:
        """Compare this replica's state-shaping settings with the last appender's (and publish
        them when appending): replicas that differ do not hold the same state."""
        try:
            key = self.log.keys.settings
            theirs: Any = self._client.get(key)
            if self._publish_settings:
                self._client.set(key, mine)
        except Exception as e:
            log.warning("could not compare settings with the event log",
                        extra={"err": f"{type(e).__name__}: {e}"})
            return
        if theirs is not None and theirs != mine:
            self.metrics.settings_mismatch.set(1)
            log.warning(
                "this replica's index settings differ from the last appending replica's; "
                "replicas will not hold the same state (docs/event-log.md, the time rule)",
                extra={"mine": mine.decode(errors="replace"),
                       "published": bytes(theirs).decode(errors="replace")})
        else:
            self.metrics.settings_mismatch.set(0)

    def _position_intact(self) -> bool:
        """Whether the entry this replica applied last is still in the log with its number."""
        sid = self._anchor or self.position.stream_id
        rows: Any = self._client.xrange(self.log.keys.log, sid, sid, count=1)
        if not rows:
            return False
        try:
            return int(rows[0][1].get(b"n", b"0")) == self.position.seq
        except (ValueError, TypeError):
            return False

    def _policy_before(self, seq: int) -> None:
        """Before replaying from entry ``seq`` (older ones trimmed): the newest policy body,
        when its own entry is among the trimmed ones."""
        raw: dict[bytes, bytes] = self._client.hgetall(self.log.keys.policy)  # type: ignore[assignment]
        try:
            n = int(raw.get(b"n", b"0"))
        except ValueError:
            return
        body = raw.get(b"body")
        if body and 0 < n < seq:
            self.applier.apply(codec.Entry(0, "", [(codec.KIND_POLICY, body)]))

    # -- snapshots --------------------------------------------------------------------------

    def _maybe_snapshot(self) -> None:
        if not self.write_snapshots or self.snapshots is None:
            return
        if time.monotonic() - self._last_snapshot < self.snapshot_interval:
            return
        if self.position == self._snapshot_pos or self.position.seq == 0:
            self._last_snapshot = time.monotonic()
            return
        if self._writer is not None and self._writer.is_alive():
            return
        t0 = time.perf_counter()
        with self._cond:  # between two entries; lookups wait only for the plain copy
            cap = self.index.capture_state()
            pos, t = self.position, _copy_time(self.applier)
        self._last_snapshot = time.monotonic()
        self._snapshot_pos = pos
        store = self.snapshots

        def write() -> None:
            try:
                path, size = store.write(pos, t, cap.blobs())  # encoded here, off the lock
            except OSError as e:
                self.metrics.snapshots("error").inc()
                log.warning("snapshot write failed", extra={"dir": store.dir, "err": str(e)})
                return
            self.metrics.snapshots("ok").inc()
            self.metrics.snapshot_bytes.set(size)
            self.metrics.snapshot_seconds.set(time.perf_counter() - t0)
            self.metrics.snapshot_time.set(time.time())
            log.info("snapshot written", extra={"path": path, "bytes": size,
                                                "sequence": pos.seq})

        self._writer = threading.Thread(target=write, name="eventlog-snapshot", daemon=True)
        self._writer.start()


def _copy_time(applier: Applier) -> LogTime:
    return replace(applier.time)


def _is_redis_error(e: BaseException) -> bool:
    import redis

    return isinstance(e, redis.RedisError | OSError)
