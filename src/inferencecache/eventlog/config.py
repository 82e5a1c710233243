"""Settings of one event-log participant, as one object (built from ``serve``/``gateway``
flags, or by a library user for ``Replica``)."""

from __future__ import annotations

from dataclasses import dataclass

from inferencecache.eventlog.redislog import check_url


@dataclass(frozen=True)
class EventLogConfig:
    """``url``: ``redis://HOST:PORT/DB`` or ``rediss://``; ``password`` overrides the URL's.
    ``retention`` seconds of entries kept (0: the largest hold TTL + 10 minutes, see
    docs/event-log.md "Retention"). ``snapshot_dir`` empty: no snapshots."""

    url: str
    password: str | None = None
    key_prefix: str = "inferencecache"
    retention: float = 0.0
    snapshot_dir: str = ""
    snapshot_interval: float = 300.0
    max_replica_lag: float = 2.0
    write_snapshots: bool = True
    socket_timeout: float = 5.0

    def __post_init__(self) -> None:
        check_url(self.url)
        if not self.key_prefix or any(c in self.key_prefix for c in "{}"):
            raise ValueError("the event log key prefix must be non-empty, without { or }")
        if self.retention < 0:
            raise ValueError("the event log retention must be >= 0 (0 = automatic)")
        if self.snapshot_interval <= 0:
            raise ValueError("the snapshot interval must be > 0")
        if self.max_replica_lag <= 0:
            raise ValueError("the maximum replica lag must be > 0")
