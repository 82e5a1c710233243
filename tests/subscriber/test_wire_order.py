"""Removals as the server receives them, mapper + forwarder + a real gRPC server, in both
``--batch-evictions`` modes (engine-events-and-subscriber.md §3.4 sending rules, §13 items 40-43,
46, 80).

The mapper-level tests (``test_mapping.py``) pin which actions a batch produces; these pin what
reaches the wire: per block the same in both modes, one ``PublishEvent`` per BlockRemoved event
(or per engine batch) when batched, one per evicted block otherwise. The encoded updates are
also checked byte for byte against protobuf's serialization.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from inferencecache.kvevents import decode_batch
from inferencecache.kvevents.encode import WireEvent, WireRemoved, WireStored, encode_batch
from inferencecache.subscriber.client import CacheClient
from inferencecache.subscriber.forwarder import Forwarder
from inferencecache.subscriber.lora import LoraResolver
from inferencecache.subscriber.mapping import BlockMapper
from inferencecache.subscriber.messages import (
    PREFIX_EVICTED,
    Identity,
    UpdateEncoder,
    build_update,
)
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.tiers import T1, T2
from tests.kvevents.util import payload
from tests.subscriber.recorder import RecordingServer

TS = 1767225600.125
TS_US = 1767225600125000
IDENT = Identity("r0", "m", "default", "vllm")


class Wire:
    """A mapper whose outbox is a real forwarder talking to ``server``."""

    def __init__(self, address: str, batch: bool, ignore_block_removed: bool = False) -> None:
        self.metrics = SubscriberMetrics()
        self.client = CacheClient(address)
        self.fwd = Forwarder(self.client, IDENT, self.metrics, window=60.0,
                             snapshot=lambda: [], batch_evictions=batch)
        self.mapper = BlockMapper(block_size=16, resolver=LoraResolver({}, True),
                                  outbox=self.fwd, metrics=self.metrics,
                                  ignore_block_removed=ignore_block_removed)
        self.task = asyncio.create_task(self.fwd.run())

    def run(self, *events: WireEvent, fmt: str = "vllm-0.33", ts: float = TS) -> None:
        self.mapper.apply(decode_batch(encode_batch(ts, list(events), fmt)))

    async def close(self) -> None:
        self.fwd.close()
        try:
            await asyncio.wait_for(self.task, 5.0)
        finally:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
            await self.client.close()


def store(hashes: list[Any], tokens: list[int], **kw: Any) -> WireStored:
    kw.setdefault("medium", "GPU")
    return WireStored(hashes, kw.pop("parent", None), tokens, 16, **kw)


def evictions(srv: RecordingServer) -> list[tuple[str, str, int]]:
    return [(e.prefix_hash.hex(), e.adapter_id, e.timestamp_us) for e in srv.servicer.events()
            if e.type == PREFIX_EVICTED]


async def test_s13_41_eviction_with_the_batch_ts_unknown_hash_sends_nothing(
    server: RecordingServer, batch: bool
) -> None:
    w = Wire(server.address, batch)
    w.run(store([1], list(range(16))))
    w.run(WireRemoved([99], medium="GPU"))
    w.run(WireRemoved([1], medium="GPU"), ts=TS + 1)
    await w.close()
    assert server.servicer.kinds() == ["update", "PREFIX_EVICTED"]
    assert evictions(server) == [("d47a8f41c833328a", "", TS_US + 1_000_000)]
    assert len(server.servicer.publish_calls()) == 1


async def test_s13_42_adds_before_the_removal_on_the_wire(
    server: RecordingServer, batch: bool
) -> None:
    w = Wire(server.address, batch)
    w.run(store([1, 2], list(range(32))), WireRemoved([2], medium="GPU"))
    await w.close()
    assert server.servicer.kinds() == ["update", "PREFIX_EVICTED"]
    assert [p[1] for p in server.servicer.prefixes()] == [16, 32]


async def test_s13_43_t2_report_is_its_own_update_in_l2_mode(
    server: RecordingServer, batch: bool
) -> None:
    w = Wire(server.address, batch, ignore_block_removed=True)
    w.run(store([1], list(range(16))))
    w.run(WireRemoved([1], medium="GPU"), store([2], list(range(100, 116))), ts=TS + 2)
    await w.close()
    updates = server.servicer.updates()
    assert [[p.tier for p in u.prefixes] for u in updates] == [[T1], [T2], [T1]]
    assert updates[1].timestamp_us == TS_US + 2_000_000
    assert evictions(server) == []


async def test_s13_46_offload_fixture_on_the_wire(server: RecordingServer, batch: bool) -> None:
    w = Wire(server.address, batch)
    w.mapper.apply(decode_batch(payload("vllm-map-v0.33-offload-cpu.bin")))
    await w.close()
    assert [p[3] for p in server.servicer.prefixes()] == [T1, T1, T2]
    assert [e[0] for e in evictions(server)] == ["d6d4b41ea7e2c328"]


async def test_s13_80_sglang_coalesced_removal(server: RecordingServer, batch: bool) -> None:
    w = Wire(server.address, batch)
    w.run(store([-1, -2, -3], list(range(1, 49))), fmt="sglang-0.5.18")
    w.run(WireRemoved([-1, -2, -3], medium="GPU"), fmt="sglang-0.5.18")
    await w.close()
    want = ["ea06fc71a5ee6e88", "ad01835a37dd294c", "0d55e56c2bccbd1a"]
    calls = server.servicer.publish_calls()
    if batch:  # one message, the hashes in order: prefix_hash first, then prefix_hashes
        assert len(calls) == 1
        assert [calls[0].prefix_hash.hex(), *(h.hex() for h in calls[0].prefix_hashes)] == want
        assert [e[0] for e in evictions(server)] == want
    else:  # one per block (sent concurrently: commuting removals)
        assert len(calls) == 3 and not any(c.prefix_hashes for c in calls)
        assert sorted(e[0] for e in evictions(server)) == sorted(want)


async def test_a_whole_engine_batch_of_removals_is_one_publish(
    server: RecordingServer, batch: bool
) -> None:
    """A full cache: every store evicts, interleaved per request inside one engine batch."""
    w = Wire(server.address, batch)
    w.run(*(store([i], list(range(16 * i, 16 * i + 16))) for i in range(1, 11)))
    events: list[WireEvent] = []
    for i in range(11, 21):
        events += [WireRemoved([i - 10], medium="GPU"), store([i], list(range(16 * i,
                                                                               16 * i + 16)))]
    w.run(*events, ts=TS + 3)
    await w.close()
    assert len(evictions(server)) == 10 and len(server.servicer.prefixes()) == 20
    n_calls = len(server.servicer.publish_calls())
    assert n_calls == 1 if batch else n_calls == 10
    assert w.metrics.registry.get_sample_value("inferencecache_subscriber_evictions_total") == 10


def test_s13_40_encoded_update_is_protobufs_serialization() -> None:
    entries = [(i.to_bytes(8, "big"), 16 * (i + 1), "" if i % 3 else "sql-lora", T1 if i % 2
                else T2) for i in range(50)]
    for ts in (0, TS_US, -5):
        want = build_update(IDENT, entries, ts).SerializeToString()
        assert UpdateEncoder(IDENT).encode(entries, ts) == want
    data = UpdateEncoder(IDENT).encode(entries[:2], 0)
    assert data.count(b"\x28\x01") + data.count(b"\x28\x02") == 2  # tier written explicitly


async def test_a_server_without_the_batch_field_gets_one_publish_per_hash() -> None:
    """An older server (its reflected CacheEvent has no field 8) or one without reflection
    would apply only ``prefix_hash`` of a batch: the subscriber sends one PublishEvent per hash
    there, and batches again after reconnecting to a server that has the field."""
    tokens = list(range(48))
    for contract in ("old", "none"):
        async with RecordingServer(contract=contract) as srv:
            w = Wire(srv.address, batch=True)
            try:
                w.run(store([1, 2, 3], tokens), WireRemoved([1, 2, 3], "GPU"))
                await srv.servicer.wait_for(lambda: len(evictions(srv)) == 3)
                calls = srv.servicer.publish_calls()
                assert len(calls) == 3 and not any(c.prefix_hashes for c in calls), contract
                assert await w.client.supports_batched_evictions() is False
                w.client.forget_capabilities()  # what a reconnect does
                assert await w.client.supports_batched_evictions() is False
            finally:
                await w.close()
    async with RecordingServer(contract="current") as srv:
        w = Wire(srv.address, batch=True)
        try:
            assert await w.client.supports_batched_evictions() is True
            w.run(store([1, 2, 3], tokens), WireRemoved([1, 2, 3], "GPU"))
            await srv.servicer.wait_for(lambda: len(evictions(srv)) == 3)
            assert len(srv.servicer.publish_calls()) == 1
        finally:
            await w.close()
