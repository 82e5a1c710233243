"""The shared loop-keeping helpers: reason labels, the rate-limited log, the drop counter and
the supervisor's restart, backoff and health states."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from inferencecache.supervise import (
    DROP_REASONS,
    Drops,
    LoopSupervisor,
    RateLimitedLog,
    describe,
    drop_counter,
    drop_reason,
)


def test_every_exception_maps_to_a_bounded_reason() -> None:
    cases = {
        RecursionError(): "nesting", MemoryError(): "memory",
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "x"): "unicode", OverflowError(): "overflow",
        KeyError(1): "lookup", IndexError(): "lookup", TypeError(): "type", ValueError(): "value",
        RuntimeError(): "internal", AttributeError(): "internal", ZeroDivisionError(): "internal",
    }
    for exc, reason in cases.items():
        assert drop_reason(exc) == reason
        assert reason in DROP_REASONS


def test_describe_names_the_innermost_frame_and_bounds_the_text() -> None:
    def inner() -> None:
        raise ValueError("x" * 1000)

    try:
        inner()
    except ValueError as e:
        text = describe(e)
    assert text.startswith("ValueError: " + "x" * 200 + " (")
    assert "in inner)" in text and len(text) < 300


def test_rate_limited_log_suppresses_and_reports_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("t"), every=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        assert limited(logging.WARNING, "k", "m")
        assert not limited(logging.WARNING, "k", "m")
        assert not limited(logging.WARNING, "k", "m")
        assert limited(logging.WARNING, "other", "m")  # keys are independent
        now[0] = 10.0
        assert limited(logging.WARNING, "k", "m")
    assert [getattr(r, "suppressed", 0) for r in caplog.records] == [0, 0, 2]


def test_drops_count_by_loop_and_reason() -> None:
    reg = CollectorRegistry()
    drops = Drops(drop_counter("x_", reg), logging.getLogger("t"))
    assert drops.drop("a", RecursionError()) == "nesting"
    drops.drop("a", RecursionError())
    drops.drop("b", KeyError(1))
    assert reg.get_sample_value("x_dropped_inputs_total", {"loop": "a", "reason": "nesting"}) == 2
    assert reg.get_sample_value("x_dropped_inputs_total", {"loop": "b", "reason": "lookup"}) == 1


async def test_supervisor_restarts_with_backoff_and_ends_when_the_loop_returns() -> None:
    reg = CollectorRegistry()
    sup = LoopSupervisor("x_", reg, logging.getLogger("t"), backoff_min=0.01, backoff_max=0.02)
    runs = 0
    healths: list[str | None] = []

    async def loop() -> None:
        nonlocal runs
        runs += 1
        healths.append(sup.health())
        if runs < 4:
            raise ValueError("boom")

    task = sup.spawn("l", loop)
    await asyncio.wait_for(task, 5)
    assert runs == 4
    assert healths == [None] * 4  # running while called
    assert reg.get_sample_value("x_loop_restarts_total", {"loop": "l"}) == 3
    assert reg.get_sample_value("x_loop_up", {"loop": "l"}) == 0
    assert sup.health() is None and sup.degraded() == []  # ended normally: not degraded


async def test_supervisor_reports_degraded_while_waiting_and_stops_on_cancel() -> None:
    reg = CollectorRegistry()
    sup = LoopSupervisor("x_", reg, logging.getLogger("t"), backoff_min=30.0)

    async def loop() -> None:
        raise KeyError("secret input bytes")

    task = sup.spawn("l", loop)
    for _ in range(100):
        if sup.degraded():
            break
        await asyncio.sleep(0.01)
    assert sup.health() == "degraded: l restarting after 1 failure(s): KeyError"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sup.health() is None
