"""No single input stops the subscriber (issue 15 item 1): the worst frames and payloads over
real ZeroMQ into a running subscriber, a hostile engine /metrics page over real HTTP, injected
bugs in the loops; every time the input is dropped and counted, a valid batch afterwards still
reaches a real gRPC server, and a loop that dies is restarted and reported by /healthz."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from inferencecache.kvevents.decode import REJECT_REASONS, BatchRejected, decode_untyped
from inferencecache.supervise import DROP_REASONS
from tests.kvevents.rawpack import worst_shapes
from tests.subscriber.test_app import Stack, stack


async def until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def rejected(st: Stack) -> float:
    return sum(st.value("batches_rejected_total", reason=r) for r in REJECT_REASONS)


def dropped(st: Stack, loop: str) -> float:
    return sum(st.value("dropped_inputs_total", loop=loop, reason=r) for r in DROP_REASONS)


async def send_valid_and_wait(st: Stack, block_hash: int) -> None:
    rec = st.server.servicer
    before = len(rec.prefixes())
    st.pub.store([block_hash], None, list(range(block_hash, block_hash + 16)), 16)
    st.pub.end_step()
    await rec.wait_for(lambda: len(rec.prefixes()) > before)


async def healthz(st: Stack) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(st.metrics_url + "/healthz") as r:
        return r.status, await r.text()


async def test_worst_payloads_over_zeromq_are_rejected_and_the_subscriber_goes_on() -> None:
    shapes = worst_shapes()
    want_rejected = 0
    for name, payload in shapes.items():
        try:
            decode_untyped(payload)
        except BatchRejected as e:
            want_rejected += 1
            if name.startswith("deep_") or "utf8" in name:
                assert e.reason == "msgpack", name
    assert want_rejected >= 15
    async with stack() as st:
        await st.warm_up()
        await send_valid_and_wait(st, 1)
        for payload in shapes.values():
            st.pub.publish_payload(payload)
        await send_valid_and_wait(st, 2)
        assert st.value("batches_received_total") == len(shapes) + 2
        assert rejected(st) == want_rejected
        assert st.value("batches_rejected_total", reason="msgpack") >= 8
        assert dropped(st, "processor") == dropped(st, "intake") == 0
        assert st.sub.healthy()
        assert await healthz(st) == (200, "ok")


async def test_worst_frames_over_zeromq_are_counted_and_the_subscriber_goes_on() -> None:
    frames: list[list[bytes]] = [
        [b""],
        [b"", b"\x00" * 8],
        [b"", b"\x00" * 8, b"", b""],
        [b"t"] * 100,
        [b"", b"", b"\x92\x00\x90"],
        [b"", b"\xff" * 9, b"\x92\x00\x90"],
        [b"", b"\x00" * 7, b"\x92\x00\x90"],
        [b"\xff" * 1_000_000, b"\x00" * 8],
    ]
    async with stack() as st:
        await st.warm_up()
        base = st.value("frames_malformed_total", reason="frame_count")
        for f in frames:
            st.pub.send_frames(f)
        await send_valid_and_wait(st, 5)
        assert st.value("frames_malformed_total", reason="frame_count") == base + 5
        assert st.value("frames_malformed_total", reason="seq_length") == 3
        assert st.sub.healthy()


async def test_an_exception_inside_the_mapper_drops_that_batch_only() -> None:
    """Fault injection: the mapper raising (a bug) is counted under loop="processor"."""
    async with stack() as st:
        await st.warm_up()
        assert st.sub.mapper is not None
        real_apply = st.sub.mapper.apply
        calls = 0

        def flaky(batch: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RecursionError("maximum recursion depth exceeded")
            real_apply(batch)

        st.sub.mapper.apply = flaky  # type: ignore[method-assign]
        st.pub.store([7], None, list(range(16)), 16)
        st.pub.end_step()
        await until(lambda: dropped(st, "processor") == 1)
        assert st.value("dropped_inputs_total", loop="processor", reason="nesting") == 1
        await send_valid_and_wait(st, 8)
        assert [p[0] for p in st.server.servicer.prefixes()]  # the valid one arrived
        assert st.sub.healthy()


async def test_a_dead_loop_is_restarted_and_healthz_says_degraded_meanwhile() -> None:
    async with stack() as st:
        await st.warm_up()
        st.sub.supervisor.backoff_min = 1.5  # long enough to observe the degraded state
        st.sub.processor.queue.put_nowait(object())  # type: ignore[arg-type]  # kills run()
        await until(lambda: st.value("loop_restarts_total", loop="processor") == 1)
        status, text = await healthz(st)
        assert status == 503
        assert text.startswith("degraded: processor restarting after 1 failure(s)")
        assert "AttributeError" in text
        assert st.value("loop_up", loop="processor") == 0
        await until(lambda: st.sub.healthy())
        assert await healthz(st) == (200, "ok")
        assert st.value("loop_up", loop="processor") == 1
        await send_valid_and_wait(st, 9)


async def test_a_hostile_engine_metrics_page_fails_the_tick_not_the_loop() -> None:
    """The stats scraper reads the engine's /metrics over real HTTP; every hostile page is one
    failed tick, and a valid page afterwards is delivered."""
    pages: list[bytes] = [
        b"\xff\xfe\x00 not utf-8",
        b"vllm:num_requests_running{" * 10_000,
        b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1e999999\n",
        b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running -nan\n",
        b"x" * 3_000_000,
    ]
    good = (b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n"
            b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1\n")
    served: list[bytes] = []

    async def page(_request: web.Request) -> web.Response:
        body = pages[len(served)] if len(served) < len(pages) else good
        served.append(body)
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with stack(engine_metrics_url=f"http://127.0.0.1:{port}/metrics",
                         stats_interval=0.05) as st:
            await until(lambda: len(served) > len(pages) + 1, timeout=20)
            await until(lambda: st.value("stats_ticks_total", result="ok") >= 1)
            assert st.value("stats_ticks_total", result="scrape_failed") >= 2  # utf-8, `{`
            assert st.value("loop_restarts_total", loop="stats") == 0
            assert st.sub.healthy()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("depth", [1_000, 100_000])
async def test_issue_15_reproduction_deep_nesting_does_not_stop_indexing(depth: int) -> None:
    """The reported bug: ~1000 nested arrays killed the processor and /healthz went 503."""
    async with stack() as st:
        await st.warm_up()
        st.pub.publish_payload(b"\x92\x00\x91" + b"\x91" * depth + b"\xc0")
        await send_valid_and_wait(st, 11)
        assert st.value("batches_rejected_total", reason="msgpack") == 1
        assert st.value("loop_restarts_total", loop="processor") == 0
        assert await healthz(st) == (200, "ok")
