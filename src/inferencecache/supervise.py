"""Keeping long-running loops alive: no single input may stop a loop.

Two layers every component shares. :class:`Drops`: when handling one input (a frame, a batch,
a request, a scrape) raises something the code did not expect, that input is dropped, counted
under a bounded ``reason`` label and logged at most once per key and interval, and the loop goes
on. :class:`LoopSupervisor`: a loop that dies anyway is logged, counted and restarted after a
short backoff, and :meth:`LoopSupervisor.health` reports it (``/healthz`` says "degraded" while a
loop waits to be restarted). Imports no component package.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge

from inferencecache.metrics import LazyChildren

__all__ = [
    "DROP_REASONS",
    "Drops",
    "LoopSupervisor",
    "RateLimitedLog",
    "describe",
    "drop_reason",
]

LOG_EVERY: Final = 10.0
"""Seconds between two log lines of the same key (the lines in between are counted)."""

DROP_REASONS: Final = (
    "nesting",  # RecursionError: nested deeper than the decoder's stack allows
    "memory",  # MemoryError: a declared or real size too large to hold
    "unicode",  # invalid UTF-8 (or another codec error)
    "overflow",  # an integer or float out of range
    "lookup",  # KeyError / IndexError
    "type",  # TypeError
    "value",  # any other ValueError
    "internal",  # anything else: a bug
)


def drop_reason(exc: BaseException) -> str:
    """The bounded metric label for an exception (one of :data:`DROP_REASONS`)."""
    if isinstance(exc, RecursionError):
        return "nesting"
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, UnicodeError):
        return "unicode"
    if isinstance(exc, OverflowError):
        return "overflow"
    if isinstance(exc, LookupError):
        return "lookup"
    if isinstance(exc, TypeError):
        return "type"
    if isinstance(exc, ValueError):
        return "value"
    return "internal"


def describe(exc: BaseException) -> str:
    """``Type: message (file:line in function)`` of the innermost frame, bounded in length: a
    full traceback of a RecursionError is a thousand frames."""
    text = f"{type(exc).__name__}: {str(exc)[:200]}"
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if frames:
        f = frames[-1]
        text += f" ({f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name})"
    return text


class RateLimitedLog:
    """At most one line per key every ``every`` seconds; the next line reports how many were
    suppressed in between (``suppressed``). Keys must come from a bounded set."""

    def __init__(
        self,
        logger: logging.Logger,
        every: float = LOG_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every = every
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, level: int, key: str, msg: str, **extra: Any) -> bool:
        """Log ``msg`` with ``extra`` unless ``key`` logged less than ``every`` s ago."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            extra["suppressed"] = suppressed
        self.logger.log(level, msg, extra=extra)
        return True


class Drops:
    """Inputs dropped because handling them raised; ``counter`` has labels ``(loop, reason)``."""

    def __init__(self, counter: Counter, logger: logging.Logger, every: float = LOG_EVERY) -> None:
        self.counter = counter
        self._children = LazyChildren(counter)
        self._log = RateLimitedLog(logger, every)

    def drop(self, loop: str, exc: BaseException, **extra: Any) -> str:
        """Count and log (rate-limited) one dropped input of ``loop``; returns the reason."""
        reason = drop_reason(exc)
        self._children(loop, reason).inc()
        self._log(
            logging.WARNING,
            f"{loop}/{reason}",
            "input dropped: handling it raised; the loop goes on",
            loop=loop,
            reason=reason,
            err=describe(exc),
            every_s=self._log.every,
            **extra,
        )
        return reason


def drop_counter(prefix: str, registry: CollectorRegistry) -> Counter:
    """The ``<prefix>dropped_inputs_total{loop, reason}`` counter of one component."""
    return Counter(
        prefix + "dropped_inputs",
        "Inputs dropped because handling them raised unexpectedly, by loop and reason.",
        ["loop", "reason"],
        registry=registry,
    )


@dataclass(slots=True)
class _LoopState:
    phase: str = "running"  # "running" | "restarting" | "ended" (returned or cancelled)
    restarts: int = 0
    last_error: str = ""  # describe(): for the log
    last_kind: str = ""  # the exception's type only: for /healthz, which anyone may read


class LoopSupervisor:
    """Runs named asyncio loops and restarts one that raises.

    A loop factory is called again after a backoff that doubles from ``backoff_min`` to
    ``backoff_max`` and resets once a run lasted ``stable_after`` seconds. A loop that returns
    normally is done (not restarted); cancelling the task returned by :meth:`spawn` stops it.
    Metrics: ``<prefix>loop_restarts_total{loop}``, ``<prefix>loop_up{loop}``.
    """

    def __init__(
        self,
        prefix: str,
        registry: CollectorRegistry,
        logger: logging.Logger,
        *,
        backoff_min: float = 0.1,
        backoff_max: float = 5.0,
        stable_after: float = 30.0,
    ) -> None:
        self.log = logger
        self.backoff_min = backoff_min
        self.backoff_max = max(backoff_max, backoff_min)
        self.stable_after = stable_after
        self.states: dict[str, _LoopState] = {}
        self._restarts = LazyChildren(
            Counter(
                prefix + "loop_restarts",
                "Loops restarted by their supervisor after dying of an exception.",
                ["loop"],
                registry=registry,
            )
        )
        self._up = LazyChildren(
            Gauge(
                prefix + "loop_up",
                "1 while the loop runs, 0 while it waits to be restarted or has ended.",
                ["loop"],
                registry=registry,
            )
        )

    def spawn(
        self, name: str, factory: Callable[[], Coroutine[Any, Any, None]]
    ) -> asyncio.Task[None]:
        """Start supervising ``factory()`` as a task named ``name``."""
        self.states[name] = _LoopState()
        self._restarts(name)  # the series exists (at 0) from the start
        return asyncio.create_task(self._supervise(name, factory), name=name)

    async def _supervise(
        self, name: str, factory: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        state = self.states[name]
        loop = asyncio.get_running_loop()
        backoff = self.backoff_min
        try:
            while True:
                state.phase = "running"
                self._up(name).set(1)
                started = loop.time()
                try:
                    await factory()
                    return
                except Exception as e:
                    state.last_error = describe(e)
                    state.last_kind = type(e).__name__
                state.phase = "restarting"
                self._up(name).set(0)
                if loop.time() - started >= self.stable_after:
                    backoff = self.backoff_min
                state.restarts += 1
                self._restarts(name).inc()
                self.log.error(
                    "loop died; restarting it",
                    extra={"loop": name, "err": state.last_error, "restarts": state.restarts,
                           "backoff_s": backoff},
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max)
        finally:
            state.phase = "ended"
            self._up(name).set(0)

    def degraded(self) -> list[str]:
        """Names of the loops waiting to be restarted."""
        return sorted(n for n, s in self.states.items() if s.phase == "restarting")

    def health(self) -> str | None:
        """``None`` while no loop waits to be restarted, else the one-line reason
        (``degraded: ...``)."""
        down = self.degraded()
        if not down:
            return None
        parts = [
            f"{n} restarting after {self.states[n].restarts} failure(s): "
            f"{self.states[n].last_kind}"
            for n in down
        ]
        return "degraded: " + "; ".join(parts)
