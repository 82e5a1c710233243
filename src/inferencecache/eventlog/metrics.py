"""The event log's metrics (docs/event-log.md, "Metrics"), registered on the caller's registry
(the server's, so one ``/metrics`` page has them; a gateway's in-process replica its own)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inferencecache.metrics import LazyChildren
from inferencecache.supervise import Drops, drop_counter

_LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class EventLogMetrics:
    """Appender, follower (replica) and snapshot series; labelled children bound lazily."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = "inferencecache_eventlog_"
        self.append_entries = Counter(p + "append_entries", "Entries appended to the log.",
                                      registry=r)
        self.append_items = LazyChildren(Counter(
            p + "append_items", "Items appended to the log, by kind.", ["kind"], registry=r))
        self.append_errors = Counter(
            p + "append_errors",
            "Appends that failed (Redis down or failing); their RPCs answered UNAVAILABLE.",
            registry=r)
        self.append_rejected = Counter(
            p + "append_rejected",
            "Items refused at once while the log was known to be down (UNAVAILABLE).",
            registry=r)
        self.append_latency = Histogram(
            p + "append_latency_seconds", "Time of one append (one entry) to Redis.",
            buckets=_LATENCY, registry=r)
        self.applied_entries = Counter(p + "applied_entries",
                                       "Entries applied by this replica.", registry=r)
        self.applied_items = LazyChildren(Counter(
            p + "applied_items", "Items applied by this replica, by kind.", ["kind"],
            registry=r))
        self.dropped = LazyChildren(Counter(
            p + "dropped",
            "Entries or items this replica could not read or apply, skipped, by reason.",
            ["reason"], registry=r))
        # what the code did not expect (an exception applying an item, in the follower loop):
        # inferencecache_eventlog_dropped_inputs_total{loop, reason}, logged rate-limited
        self.drops = Drops(drop_counter(p, r), logging.getLogger("inferencecache.eventlog"))
        self.lag_entries = Gauge(p + "replica_lag_entries",
                                 "Entries in the log not applied yet by this replica.",
                                 registry=r)
        self.lag_seconds = Gauge(
            p + "replica_lag_seconds",
            "Age of the newest applied entry while entries are pending, else 0.", registry=r)
        self.position = Gauge(p + "replica_applied_sequence",
                              "Sequence number of the last applied entry.", registry=r)
        self.ready = Gauge(p + "replica_ready",
                           "1 once the replica has caught up to within --max-replica-lag.",
                           registry=r)
        self.log_up = LazyChildren(Gauge(
            p + "redis_up", "1 while the last Redis command of this role succeeded.", ["role"],
            registry=r))
        self.reconnects = LazyChildren(Counter(
            p + "redis_errors", "Failed Redis commands (each followed by a backoff), by role.",
            ["role"], registry=r))
        self.gaps = LazyChildren(Counter(
            p + "gaps",
            "Times this replica needed entries the log no longer has (trimmed) or the log went "
            "back (rewound), by reason; each is followed by a recovery.", ["reason"],
            registry=r))
        self.recoveries = LazyChildren(Counter(
            p + "recoveries", "State rebuilds, by source (snapshot, replay).", ["source"],
            registry=r))
        self.snapshots = LazyChildren(Counter(
            p + "snapshots", "Snapshots written, by result (ok, error).", ["result"],
            registry=r))
        self.snapshot_bytes = Gauge(p + "snapshot_bytes", "Size of the newest snapshot written.",
                                    registry=r)
        self.snapshot_seconds = Gauge(
            p + "snapshot_duration_seconds", "Time the newest snapshot took (dump + write).",
            registry=r)
        self.snapshot_time = Gauge(
            p + "snapshot_timestamp_seconds",
            "Wall-clock time of the newest snapshot written or loaded (age = time() - this).",
            registry=r)
        self.settings_mismatch = Gauge(
            p + "settings_mismatch",
            "1 when this replica's state-shaping settings (TTL, sweep interval, hold cap, block "
            "size, bounds) differ from those the last appending replica published: replicas "
            "then do not hold the same state.", registry=r)
        self.snapshot_skipped = Counter(
            p + "snapshot_skipped",
            "Snapshot files skipped at load (corrupt, truncated, unusable for this log).",
            registry=r)
