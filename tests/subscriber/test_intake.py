"""The ZeroMQ intake on real sockets: frames, topics, sequence, replay and the disconnect
monitor (engine-events-and-subscriber.md §2.1, §3.1, §3.2, §13 items 17, 20-23, 85)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.asyncio

from inferencecache.engines.publisher import EventPublisher
from inferencecache.kvevents.encode import WireStored
from inferencecache.subscriber.intake import EngineGone, Intake, QueueItem, RawBatch
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.replay import ReplayClient


@dataclass
class Pair:
    ctx: zmq.asyncio.Context
    pub: EventPublisher
    intake: Intake
    queue: asyncio.Queue[QueueItem]
    metrics: SubscriberMetrics
    task: asyncio.Task[None]

    def value(self, name: str, **labels: str) -> float:
        v = self.metrics.registry.get_sample_value(
            "inferencecache_subscriber_" + name, labels or None)
        return 0.0 if v is None else v

    async def warm_up(self, topic: bytes | None = None) -> None:
        """Send 2-frame probes until one arrives: the subscription is then live."""
        topic = self.pub.topic if topic is None else topic
        before = self.value("frames_malformed_total", reason="frame_count")
        deadline = time.monotonic() + 5
        while self.value("frames_malformed_total", reason="frame_count") == before:
            assert time.monotonic() < deadline, "subscription never became live"
            self.pub.send_frames([topic, b"probe"])
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # let in-flight probes land before real traffic

    def publish(self, n: int = 1, live: bool = True) -> list[int]:
        out = []
        for _ in range(n):
            self.pub.add(WireStored([self.pub.next_seq + 1], None, list(range(16)), 16))
            seq = self.pub.end_step(live=live)
            assert seq is not None
            out.append(seq)
        return out

    async def items(self, n: int, timeout: float = 5.0) -> list[QueueItem]:
        out = []
        for _ in range(n):
            out.append(await asyncio.wait_for(self.queue.get(), timeout))
        return out

    async def nothing_more(self, wait: float = 0.2) -> None:
        await asyncio.sleep(wait)
        assert self.queue.empty(), self.queue.get_nowait()


@contextlib.asynccontextmanager
async def pair(fmt: str = "vllm-0.33", topic: str = "", sub_topic: str = "",
               replay: bool = False, buffer_steps: int = 100) -> AsyncIterator[Pair]:
    ctx = zmq.asyncio.Context()
    pub = EventPublisher(ctx, endpoint="tcp://127.0.0.1:0", topic=topic, fmt=fmt,
                         replay_endpoint="tcp://127.0.0.1:0" if replay else "",
                         buffer_steps=buffer_steps)
    pub.start()
    queue: asyncio.Queue[QueueItem] = asyncio.Queue(256)
    metrics = SubscriberMetrics()
    client = ReplayClient(ctx, pub.replay_endpoint) if replay else None
    intake = Intake(ctx, pub.endpoint, sub_topic, queue, metrics, replay=client)
    task = asyncio.create_task(intake.run())
    try:
        yield Pair(ctx, pub, intake, queue, metrics, task)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pub.close()
        ctx.destroy(linger=0)


def seqs(items: list[Any]) -> list[Any]:
    return [i.seq if isinstance(i, RawBatch) else i for i in items]


async def test_s13_17_wrong_frame_shapes_are_dropped_and_counted() -> None:
    async with pair() as p:
        await p.warm_up()
        base = p.value("frames_malformed_total", reason="frame_count")
        p.pub.send_frames([b"", b"\x00" * 8])
        p.pub.send_frames([b"", b"\x00" * 8, b"x", b"y"])
        p.pub.send_frames([b"", b"\x00" * 7, b"x"])
        p.pub.send_frames([b"", b"\x00" * 9, b"x"])
        p.publish(1)
        (item,) = await p.items(1)
        assert isinstance(item, RawBatch) and item.seq == 0
        assert p.value("frames_malformed_total", reason="frame_count") == base + 2
        assert p.value("frames_malformed_total", reason="seq_length") == 2
        await p.nothing_more()


@pytest.mark.parametrize(
    ("pub_topic", "sub_topic"),
    [("kv-events", "kv-events"), ("kv-events", ""), ("kv-events", "kv"), ("", "")],
)
async def test_s13_23_topic_prefix_filter_receives(pub_topic: str, sub_topic: str) -> None:
    async with pair(topic=pub_topic, sub_topic=sub_topic) as p:
        await p.warm_up()
        p.publish(1)
        (item,) = await p.items(1)
        assert isinstance(item, RawBatch)


async def test_s13_23_prefix_kv_does_not_receive_other() -> None:
    async with pair(topic="kv-events", sub_topic="kv") as p:
        await p.warm_up()
        p.pub.send_frames([b"other", (0).to_bytes(8, "big"), b"\x92\x00\x90"])
        p.pub.send_frames([b"kv-events", (1).to_bytes(8, "big"), b"\x92\x00\x90"])
        (item,) = await p.items(1)
        assert isinstance(item, RawBatch) and item.seq == 1
        await p.nothing_more()


async def test_s13_19_20_gap_is_counted_and_regression_clears() -> None:
    async with pair() as p:
        await p.warm_up()
        p.publish(3)  # 0, 1, 2
        p.pub.next_seq = 5
        p.publish(1)
        p.pub.next_seq = 0
        p.publish(1)
        got = await p.items(6)
        assert seqs(got) == [0, 1, 2, 5, EngineGone("seq_regression"), 0]
        assert p.value("seq_gaps_total") == 1
        assert p.value("seq_gap_batches_total") == 2
        assert p.value("missed_batches_total") == 2
        assert p.value("engine_restarts_total", cause="seq_regression") == 1


@pytest.mark.parametrize("fmt", ["vllm-0.22", "vllm-0.33"], ids=["no-topic", "topic-frame"])
async def test_s13_21_22_gap_is_filled_by_replay_before_the_live_batch(fmt: str) -> None:
    async with pair(fmt=fmt, topic="kv-events", replay=True) as p:
        await p.warm_up()
        p.publish(1)  # 0, live
        p.publish(3, live=False)  # 1..3 only in the replay buffer (a PUB drop)
        p.publish(1)  # 4, live
        got = await p.items(5)
        assert seqs(got) == [0, 1, 2, 3, 4]
        assert [i.replayed for i in got] == [False, True, True, True, False]  # type: ignore[union-attr]
        assert p.value("replays_total") == 1 and p.value("replayed_batches_total") == 3
        assert p.value("missed_batches_total") == 0
        assert p.value("seq_gap_batches_total") == 3


async def test_replay_that_lost_the_oldest_batches_counts_them_missed() -> None:
    async with pair(replay=True, buffer_steps=2) as p:
        await p.warm_up()
        p.publish(1)
        p.publish(4, live=False)  # 1..4; the buffer keeps only the last two
        p.publish(1)  # 5 (and the buffer now holds 4, 5)
        got = await p.items(3)
        assert seqs(got) == [0, 4, 5]
        assert p.value("missed_batches_total") == 3


async def test_late_joiner_replays_from_zero() -> None:
    async with pair(replay=True) as p:
        p.publish(3, live=False)  # published before the subscriber joined
        await p.warm_up()
        p.publish(1)
        got = await p.items(4)
        assert seqs(got) == [0, 1, 2, 3]
        assert [i.replayed for i in got] == [True, True, True, False]  # type: ignore[union-attr]


async def test_replay_end_marker_stops_the_wait_and_missing_router_times_out() -> None:
    ctx = zmq.asyncio.Context()
    pub = EventPublisher(ctx, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    pub.start()
    try:
        for _ in range(3):
            pub.publish_payload(b"p", live=False)
        t0 = time.monotonic()
        got = await ReplayClient(ctx, pub.replay_endpoint, timeout=3.0).fetch(1, 100)
        assert [s for s, _ in got] == [1, 2]
        assert time.monotonic() - t0 < 1.5  # ended by the end marker, not the deadline
        with zmq.Context() as tmp, tmp.socket(zmq.ROUTER) as r:
            port = r.bind_to_random_port("tcp://127.0.0.1")
            t0 = time.monotonic()
            got = await ReplayClient(ctx, f"tcp://127.0.0.1:{port}", timeout=0.3).fetch(0, 5)
            assert got == [] and 0.25 < time.monotonic() - t0 < 2.0
    finally:
        await pub.close()
        ctx.destroy(linger=0)


async def test_s13_85_publisher_disconnect_clears_once_and_next_seq_is_first() -> None:
    async with pair() as p:
        await p.warm_up()
        p.publish(4)  # 0..3
        assert seqs(await p.items(4)) == [0, 1, 2, 3]
        endpoint = p.pub.endpoint
        await p.pub.close()  # the engine process goes away
        (gone,) = await p.items(1)
        assert gone == EngineGone("disconnect")
        assert p.value("engine_restarts_total", cause="disconnect") == 1
        # A new engine on the same address, whose first visible message is seq 9.
        p.pub = EventPublisher(p.ctx, endpoint=endpoint)
        p.pub.start()
        await p.warm_up()
        p.pub.next_seq = 9
        p.publish(1)
        (item,) = await p.items(1)
        assert isinstance(item, RawBatch) and item.seq == 9
        await p.nothing_more()
        assert p.value("seq_gaps_total") == 0
        assert p.value("engine_restarts_total", cause="seq_regression") == 0
        assert p.value("engine_restarts_total", cause="disconnect") == 1
