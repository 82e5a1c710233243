"""The engine-side publisher on real sockets: framing, seq, replay ROUTER shapes."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from inferencecache.engines.cache import BlockCache
from inferencecache.engines.engine import FakeEngine
from inferencecache.engines.metrics import EngineMetrics
from inferencecache.engines.publisher import EventPublisher
from inferencecache.kvevents import BlockRemoved, BlockStored, decode_batch
from inferencecache.kvevents.framing import pack_seq


async def _sub(ctx: zmq.asyncio.Context, pub: EventPublisher) -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for _ in range(250):  # probe until the subscription is live
        pub.send_frames([b"probe"])
        if await sub.poll(20):
            while await sub.poll(50):
                await sub.recv_multipart()
            return sub
    raise AssertionError("subscription never became live")


async def test_bind_port_zero_seq_from_zero_and_three_frames() -> None:
    ctx = zmq.asyncio.Context()
    pub = EventPublisher(ctx, endpoint="tcp://127.0.0.1:0", topic="kv-events", fmt="vllm-0.22")
    pub.start()
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        sub = await _sub(ctx, pub)
        assert pub.end_step() is None  # nothing queued, nothing published
        pub.store([1, 2], None, list(range(32)), 16)
        pub.remove([2])
        assert pub.end_step(ts=5.0) == 0
        pub.clear()
        assert pub.end_step() == 1
        frames = await asyncio.wait_for(sub.recv_multipart(), 5)
        assert frames[0] == b"kv-events" and frames[1] == pack_seq(0)
        batch = decode_batch(frames[2])
        assert batch.ts == 5.0 and [type(e) for e in batch.events] == [BlockStored, BlockRemoved]
        assert len(msgspec.msgpack.decode(frames[2])[1][0]) == 12  # the 0.22 array shape
        frames = await asyncio.wait_for(sub.recv_multipart(), 5)
        assert frames[1] == pack_seq(1)
        sub.close(linger=0)
    finally:
        await pub.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize(("fmt", "width"), [("vllm-0.9", 3), ("vllm-0.33", 4)])
async def test_replay_router_answers_in_the_releases_shape(fmt: str, width: int) -> None:
    ctx = zmq.asyncio.Context()
    pub = EventPublisher(ctx, endpoint="tcp://127.0.0.1:0", fmt=fmt,
                         replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3)
    pub.start()
    try:
        for i in range(5):
            pub.publish_payload(f"p{i}".encode(), live=False)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        await dealer.send_multipart([pack_seq(0)])  # without the delimiter: ignored
        await dealer.send_multipart([b"", pack_seq(3)])
        got = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(3)]
        assert [len(f) for f in got] == [width, width, width]
        assert [f[-2] for f in got] == [pack_seq(3), pack_seq(4), b"\xff" * 8]
        assert [f[-1] for f in got] == [b"p3", b"p4", b""]
        assert all(f[0] == b"" for f in got)
        await dealer.send_multipart([b"", pack_seq(0)])  # older than the buffer: what is left
        got = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(4)]
        assert [f[-2] for f in got][:3] == [pack_seq(2), pack_seq(3), pack_seq(4)]
        dealer.close(linger=0)
    finally:
        await pub.close()
        ctx.destroy(linger=0)


async def test_fake_engine_publishes_evictions_then_the_chained_store() -> None:
    ctx = zmq.asyncio.Context()
    pub = EventPublisher(ctx, endpoint="tcp://127.0.0.1:0")
    pub.start()
    try:
        engine = FakeEngine(pub, BlockCache(4, capacity=2), EngineMetrics("m"))
        engine.serve(list(range(8)))
        engine.end_step()
        engine.serve(list(range(8)) + list(range(50, 54)), lora_id=1, lora_name="sql-lora")
        engine.end_step()
        engine.serve(list(range(100, 104)))
        engine.end_step()
        payloads = [p for _, p in pub.buffer]
        second = decode_batch(payloads[1]).events  # 3 adapter blocks: both base blocks go
        assert [type(e) for e in second] == [BlockRemoved, BlockRemoved, BlockStored]
        stored = second[-1]
        assert isinstance(stored, BlockStored)
        assert stored.lora_name == "sql-lora" and stored.lora_id == 1
        assert len(stored.block_hashes) == 3 and stored.parent_block_hash is None
        third = decode_batch(payloads[2]).events
        assert [type(e) for e in third] == [BlockRemoved] * 2 + [BlockStored]
        assert len(engine.cache) == 2
        usage = engine.metrics.registry.get_sample_value(
            "vllm:kv_cache_usage_perc", {"model_name": "m", "engine": "0"})
        assert usage == 1.0
    finally:
        await pub.close()
        ctx.destroy(linger=0)
