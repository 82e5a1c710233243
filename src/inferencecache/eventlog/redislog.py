"""The log on Redis (or Valkey) Streams: key names, the two Lua scripts, connections.

Keys (docs/event-log.md, "Stream layout"), all under one hash tag so Redis Cluster keeps them
in one slot and the scripts may touch them together:

- ``{PREFIX}:log``: the stream. Each entry has two fields: ``n`` (the entry's sequence number,
  ASCII decimal, 1, 2, 3, ... without holes) and ``d`` (the entry bytes, ``codec``).
- ``{PREFIX}:seq``: the last sequence number handed out (a Redis integer).
- ``{PREFIX}:policy``: hash ``n``, ``id``, ``body`` of the newest policy entry, for a replica
  that replays a log whose older entries were trimmed.
- ``{PREFIX}:settings``: the state-shaping index settings of the last appending replica that
  started (JSON), compared by every replica at start (a mismatch is logged and exported).

The sequence number is what makes a gap visible: a replica that applied ``n`` expects
``n + 1`` next; a larger number means entries were trimmed before it read them, a smaller one
that the log went back (Redis lost writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

APPEND_SCRIPT: Final = """
local n = redis.call('INCR', KEYS[2])
local id = redis.call('XADD', KEYS[1], '*', 'n', n, 'd', ARGV[1])
if ARGV[2] == '1' then
  redis.call('HSET', KEYS[3], 'n', n, 'id', id, 'body', ARGV[3])
end
return {id, n}
"""
"""Append one entry with the next sequence number (atomic: a script), and remember the newest
policy body when the entry carries one."""

TRIM_SCRIPT: Final = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local minid = now_ms - tonumber(ARGV[1])
if minid <= 0 then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', minid)
"""
"""Delete the entries older than ARGV[1] ms by Redis's own clock (the clock of entry ids)."""

ZERO_ID: Final = b"0-0"


class LogUnavailable(Exception):
    """The log cannot take an append now (Redis down or failing); callers answer UNAVAILABLE."""


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.hostname or ""
    netloc = f"{parts.username}:***@{netloc}" if parts.username else f":***@{netloc}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return parts._replace(netloc=netloc).geturl()


def check_url(url: str) -> None:
    """Raise ValueError naming the problem of an unusable ``--event-log`` URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"{redact(url)}: the scheme must be redis:// or rediss://")
    if not parts.hostname:
        raise ValueError(f"{redact(url)}: no host")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise ValueError(f"{redact(url)}: {e}") from e
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"{redact(url)}: the path must be a database number")


@dataclass(frozen=True)
class Keys:
    """The key names of one log (``prefix`` = ``--event-log-key``)."""

    prefix: str = "inferencecache"

    @property
    def log(self) -> str:
        return f"{{{self.prefix}}}:log"

    @property
    def seq(self) -> str:
        return f"{{{self.prefix}}}:seq"

    @property
    def policy(self) -> str:
        return f"{{{self.prefix}}}:policy"

    @property
    def settings(self) -> str:
        return f"{{{self.prefix}}}:settings"


class RedisLog:
    """Connections to one log. Each user (appender, follower) takes its own client: a follower's
    blocking read must not delay an append."""

    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        key_prefix: str = "inferencecache",
        socket_timeout: float = 5.0,
    ) -> None:
        check_url(url)
        self.url = url
        self.password = password
        self.keys = Keys(key_prefix)
        self.socket_timeout = socket_timeout

    def client(self, *, read_timeout: float | None = None) -> redis.Redis:
        """A new client (lazy: it connects on the first command). ``read_timeout`` must exceed
        any BLOCK the caller uses."""
        kwargs: dict[str, Any] = {
            "socket_timeout": read_timeout if read_timeout is not None else self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            "health_check_interval": 0,
            "retry_on_timeout": False,
            "retry": Retry(NoBackoff(), 0),  # our loops decide when to try again
        }
        if self.password is not None:
            kwargs["password"] = self.password
        return redis.Redis.from_url(self.url, **kwargs)

    def describe(self) -> str:
        return f"{redact(self.url)} {self.keys.log}"
