"""Per-connection sequence tracking of the live stream (engine-events-and-subscriber.md §3.2).

Pure bookkeeping, no I/O: the intake asks what a seq means and acts on the verdict.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Seq(enum.Enum):
    FIRST = "first"  # first message after (re)connect or start: accepted whatever its value
    NEXT = "next"  # last + 1
    GAP = "gap"  # > last + 1: `missed` batches never arrived
    RESTART = "restart"  # <= last: the publisher restarted (a live PUB never repeats)


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: Seq
    last: int | None  # the previous seq (None for FIRST)
    missed: int = 0


class SequenceTracker:
    """Remembers the last seq of the current connection."""

    def __init__(self) -> None:
        self._last: int | None = None

    @property
    def last(self) -> int | None:
        return self._last

    def reset(self) -> None:
        """Forget the stream: the next message is the first after (re)connect."""
        self._last = None

    def observe(self, seq: int) -> Verdict:
        """Classify ``seq`` and make it the last one."""
        last = self._last
        self._last = seq
        if last is None:
            return Verdict(Seq.FIRST, None)
        if seq == last + 1:
            return Verdict(Seq.NEXT, last)
        if seq > last + 1:
            return Verdict(Seq.GAP, last, seq - last - 1)
        return Verdict(Seq.RESTART, last)
