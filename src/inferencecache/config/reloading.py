"""A config file re-read when it changes: ``serve --pd-topology-file`` (and each file of
``--template-dir``, through ``templates.registry``).

The change check is one ``stat`` at most every ``every`` seconds, made by the caller that
needs the value, so no thread is needed and an idle server does no I/O. A changed file that
no longer parses keeps the last good version in use: counted in
``inferencecache_server_config_reloads_total{file, result="error"}`` and logged (rate-limited);
the bad file never takes the running server down. At startup the first read must succeed
(``serve`` exits 2 naming the problem).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from prometheus_client import Counter

from inferencecache.supervise import RateLimitedLog

log = logging.getLogger("inferencecache.config")

_T = TypeVar("_T")

RELOAD_CHECK_S = 1.0
"""How often (at most) a file is stat'ed for a change."""

Signature = tuple[int, int, int]


def signature(path: str | Path) -> Signature | None:
    """(mtime_ns, size, inode) of ``path``, or None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class ReloadingFile(Generic[_T]):
    """The parsed content of one file, re-parsed after the file changed."""

    def __init__(
        self,
        path: str | Path,
        load: Callable[[Path], _T],
        *,
        kind: str,
        reloads: Counter | None = None,
        every: float = RELOAD_CHECK_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._load = load
        self._kind = kind
        self._reloads = reloads
        self._every = every
        self._mono = monotonic
        self._lock = threading.Lock()
        self._logs = RateLimitedLog(log)
        self._sig = signature(self.path)
        self._value = load(self.path)  # startup: errors propagate
        self._checked = monotonic()

    def get(self) -> _T:
        """The current value (re-read first when the file changed since the last check)."""
        now = self._mono()
        if now - self._checked < self._every:
            return self._value
        with self._lock:
            if now - self._checked >= self._every:
                self._checked = now
                self._refresh()
        return self._value

    def _refresh(self) -> None:
        sig = signature(self.path)
        if sig == self._sig:
            return
        self._sig = sig
        try:
            value = self._load(self.path)
        except Exception as e:
            self._count("error")
            self._logs(logging.WARNING, f"reload/{self._kind}",
                       "config file changed but is invalid; keeping the last good version",
                       file=str(self.path), err=" ".join(str(e).split()),
                       every_s=self._logs.every)  # fmt: skip
            return
        self._value = value
        self._count("ok")
        log.info("config file reloaded", extra={"file": str(self.path), "kind": self._kind})

    def _count(self, result: str) -> None:
        if self._reloads is not None:
            self._reloads.labels(self._kind, result).inc()
