"""The shared event log on Redis Streams (docs/event-log.md): every replica applies the same
entries in the same order, so every replica answers the same.

Data flows one way: the server validates an ingest message and appends it (``LogNode``,
``Appender``), Redis orders it, and every replica's ``Follower`` applies it to its own index
(``Applier``), the appending one included. ``Replica`` is the public in-process replica.
The index knows nothing of Redis.
"""

from inferencecache.eventlog.config import EventLogConfig
from inferencecache.eventlog.metrics import EventLogMetrics
from inferencecache.eventlog.redislog import LogUnavailable, RedisLog
from inferencecache.eventlog.replica import LogNode, Replica

__all__ = ["EventLogConfig", "EventLogMetrics", "LogNode", "LogUnavailable", "RedisLog",
           "Replica"]
