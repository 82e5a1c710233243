"""Batching, ordered RPCs, backoff and resync against a real gRPC server on loopback
(engine-events-and-subscriber.md §3.5, §3.7, §13 items 42, 48-55)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from typing import Any

import grpc
import grpc.aio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferencecache.procs import free_port
from inferencecache.subscriber.client import RPC_DEADLINE, CacheClient
from inferencecache.subscriber.forwarder import Forwarder
from inferencecache.subscriber.mapping import Block
from inferencecache.subscriber.messages import (
    ALL_CLEARED,
    PREFIX_EVICTED,
    Entry,
    Identity,
    UpdateEncoder,
    build_event,
    build_update,
    timestamp_us,
)
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.resync import watch_connectivity
from inferencecache.subscriber.tiers import GPU_ONLY, T1, T2
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from tests.subscriber.recorder import RecordingServer

IDENT = Identity("replica-a", "model-x", "tenant-t", "vllm")


async def eventually(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def entry(i: int, tier: int = T1, adapter: str = "") -> Entry:
    return (i.to_bytes(8, "big"), 16 * (i % 100 + 1), adapter, tier)


class Rig:
    """A forwarder wired to a real server; the snapshot comes from ``state``."""

    def __init__(self, address: str, window: float = 0.02, deadline: float = 5.0,
                 **kw: Any) -> None:
        self.client = CacheClient(address, deadline=deadline)
        self.metrics = SubscriberMetrics()
        self.state: list[Block] = []
        self.fwd = Forwarder(self.client, IDENT, self.metrics, window=window,
                             snapshot=lambda: [list(self.state)], **kw)
        self.task = asyncio.create_task(self.fwd.run())

    def value(self, name: str, **labels: str) -> float:
        v = self.metrics.registry.get_sample_value(
            "inferencecache_subscriber_" + name, labels or None)
        return 0.0 if v is None else v

    async def close(self, timeout: float = 5.0) -> None:
        self.fwd.close()
        try:
            await asyncio.wait_for(self.task, timeout)
        finally:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
            await self.client.close()


async def test_s13_49_adds_within_the_window_go_out_as_one_update(
    server: RecordingServer,
) -> None:
    rig = Rig(server.address, window=0.02)
    t0 = time.monotonic()
    rig.fwd.add_many([entry(1), entry(2)], 1_000_000)
    rig.fwd.add_many([entry(3)], 2_000_000)
    await server.servicer.wait_for(lambda: server.servicer.updates())
    assert time.monotonic() - t0 < 2.0  # the window (20 ms), not a stall
    assert server.servicer.streams == 1
    assert [p[0] for p in server.servicer.prefixes()] == [entry(i)[0].hex() for i in (1, 2, 3)]
    await rig.close()


async def test_s13_50_4096_pending_entries_flush_at_once(server: RecordingServer) -> None:
    rig = Rig(server.address, window=60.0)
    rig.fwd.add_many([entry(i) for i in range(4095)], 1)
    await asyncio.sleep(0.2)
    assert server.servicer.updates() == []  # below the bound: waits for the 60 s window
    rig.fwd.add_many([entry(4095)], 1)
    await server.servicer.wait_for(lambda: server.servicer.updates())
    assert len(server.servicer.updates()[0].prefixes) == 4096
    await rig.close()


async def test_big_events_are_split_into_bounded_updates(server: RecordingServer) -> None:
    rig = Rig(server.address, window=60.0)
    rig.fwd.add_many([entry(i) for i in range(10000)], 1)
    await server.servicer.wait_for(lambda: len(server.servicer.prefixes()) == 10000)
    assert [len(u.prefixes) for u in server.servicer.updates()] == [4096, 4096, 1808]
    await rig.close()


async def test_s13_51_52_update_identity_and_timestamp(server: RecordingServer) -> None:
    rig = Rig(server.address, window=0.02)
    rig.fwd.add_many([entry(1)], 1_500_000)
    rig.fwd.add_many([entry(2)], 0)  # a batch with ts <= 0 does not reset the stamp
    await server.servicer.wait_for(lambda: server.servicer.updates())
    u = server.servicer.updates()[0]
    assert (u.replica_id, u.model_id, u.tenant_id, u.hash_scheme) == (
        "replica-a", "model-x", "tenant-t", "vllm")
    assert u.timestamp_us == 1_500_000 and u.adapter_id == "" and not u.HasField("stats")
    rig.fwd.add_many([entry(3)], 0)
    await server.servicer.wait_for(lambda: len(server.servicer.updates()) == 2)
    assert server.servicer.updates()[1].timestamp_us == 0
    await rig.close()


INT64_MAX = 2**63 - 1
# engine ts (seconds) that must become timestamp_us 0 ("now" at the server): ts <= 0, NaN,
# infinities, and values whose microseconds do not fit the int64 wire field
ZERO_TS: list[float | int] = [
    0.0, -0.0, -1.0, -1e-9, -1e300, float("nan"), -float("nan"), float("inf"), -float("inf"),
    1e300, 9.3e12, float(2**63), 5e-324, 4e-7,  # the last two: positive but below 1 µs
    0, -1, -(2**63), 2**63, 2**64 - 1, 10**30,
]


def _on_the_wire(ts_us: int) -> tuple[int, int]:
    """``ts_us`` through both encoders of an update and through an event: what a server reads."""
    e = entry(1)
    fast = UpdateEncoder(IDENT).encode([e], ts_us)
    assert fast == build_update(IDENT, [e], ts_us).SerializeToString()
    event = build_event(IDENT, ALL_CLEARED, ts_us).SerializeToString()
    return (pb.CacheStateUpdate.FromString(fast).timestamp_us,
            pb.CacheEvent.FromString(event).timestamp_us)


@pytest.mark.parametrize("ts", ZERO_TS, ids=repr)
def test_s13_52_odd_engine_ts_becomes_zero_on_the_wire(ts: float) -> None:
    assert timestamp_us(ts) == 0
    assert _on_the_wire(timestamp_us(ts)) == (0, 0)


def test_s13_52_positive_ts_is_truncated_microseconds() -> None:
    assert timestamp_us(1767225600.125) == 1_767_225_600_125_000
    assert timestamp_us(1767225600) == 1_767_225_600_000_000  # a msgpack int ts
    assert timestamp_us(1.9999999) == 1_999_999  # truncated, not rounded
    assert timestamp_us(1e-6) == 1
    top = timestamp_us(9.2e12)  # still fits int64
    assert top == 9_200_000_000_000_000_000
    assert _on_the_wire(top) == (top, top)


@settings(max_examples=300, deadline=None)
@given(ts=st.floats(allow_nan=True, allow_infinity=True)
       | st.integers(min_value=-(2**63), max_value=2**64 - 1))
def test_s13_52_any_engine_ts_never_raises_and_stays_in_int64(ts: float) -> None:
    us = timestamp_us(ts)
    assert type(us) is int and 0 <= us <= INT64_MAX
    if not ts > 0:  # ts <= 0 and NaN
        assert us == 0
    elif ts * 1e6 < 2**62:  # comfortably representable: int(ts x 1e6), truncated
        assert us == int(ts * 1e6)
    elif ts * 1e6 >= 2**63:  # does not fit the int64 field (inf included): "now"
        assert us == 0
    assert _on_the_wire(us) == (us, us)


async def test_s13_42_adds_reach_the_server_before_the_eviction(
    server: RecordingServer, batch: bool,
) -> None:
    rig = Rig(server.address, batch_evictions=batch, window=60.0)
    rig.fwd.add_many([entry(1)], 5)
    rig.fwd.flush()
    rig.fwd.evict(entry(1)[0], "sql-lora", 7)
    await server.servicer.wait_for(lambda: len(server.servicer.log) == 2)
    assert server.servicer.kinds() == ["update", "PREFIX_EVICTED"]
    ev = server.servicer.events()[0]
    assert (ev.prefix_hash, ev.adapter_id, ev.timestamp_us) == (entry(1)[0], "sql-lora", 7)
    assert (ev.replica_id, ev.model_id, ev.tenant_id) == ("replica-a", "model-x", "tenant-t")
    await rig.close()


async def test_s13_43_t2_report_is_its_own_update_with_the_eviction_ts(
    server: RecordingServer,
) -> None:
    rig = Rig(server.address, window=60.0)
    rig.fwd.add_many([entry(1)], 5)
    rig.fwd.flush()
    rig.fwd.report([entry(1, T2)], 9)
    rig.fwd.add_many([entry(2)], 11)
    rig.fwd.flush()
    await server.servicer.wait_for(lambda: len(server.servicer.updates()) == 3)
    ts = [u.timestamp_us for u in server.servicer.updates()]
    tiers = [[p.tier for p in u.prefixes] for u in server.servicer.updates()]
    assert ts == [5, 9, 11] and tiers == [[T1], [T2], [T1]]
    await rig.close()


async def test_s13_48_clear_discards_pending_adds(server: RecordingServer, batch: bool) -> None:
    rig = Rig(server.address, batch_evictions=batch, window=60.0)
    rig.fwd.add_many([entry(1)], 5)
    rig.fwd.clear(6)
    await server.servicer.wait_for(lambda: server.servicer.log)
    await asyncio.sleep(0.1)
    assert server.servicer.kinds() == ["ALL_CLEARED"]
    assert server.servicer.events()[0].timestamp_us == 6
    assert server.servicer.events()[0].prefix_hash == b""
    await rig.close()


async def test_s13_55_closing_flushes_pending_adds(server: RecordingServer) -> None:
    rig = Rig(server.address, window=60.0)
    rig.fwd.add_many([entry(1), entry(2)], 5)
    await rig.close()
    assert len(server.servicer.prefixes()) == 2
    assert rig.value("prefixes_reported_total", tier="T1") == 2


async def test_s13_53_failing_server_drops_with_warnings_and_returns_on_close(
    server: RecordingServer, batch: bool, caplog: pytest.LogCaptureFixture
) -> None:
    server.servicer.fail = True
    rig = Rig(server.address, batch_evictions=batch, window=0.01)
    for i in range(30):
        rig.fwd.add_many([entry(i)], 1)
        rig.fwd.evict(entry(i)[0], "", 1)
        await asyncio.sleep(0.02)
    assert any(r.getMessage().startswith("report send failed; dropping batch")
               or r.getMessage() == "publish event failed; dropping"
               for r in caplog.records if r.levelno == logging.WARNING)
    # Backoff: far fewer attempts than items (about 5 in 0.6 s, not 60).
    assert server.servicer.attempts <= 8
    assert rig.value("rpc_failures_total", rpc="ReportCacheState") + rig.value(
        "rpc_failures_total", rpc="PublishEvent") >= 1
    assert rig.value("adds_not_sent_total") >= 20
    t0 = time.monotonic()
    await rig.close(timeout=2.0)
    assert time.monotonic() - t0 < 2.0


async def test_s13_53_each_rpc_has_a_deadline(server: RecordingServer) -> None:
    server.servicer.hang = 3.0
    rig = Rig(server.address, window=0.01, deadline=0.3)
    rig.fwd.add_many([entry(1)], 1)
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    while rig.value("rpc_failures_total", rpc="ReportCacheState") < 1:
        assert time.monotonic() - t0 < 2.0, "the RPC was not cut by its deadline"
        await asyncio.sleep(0.02)
    server.servicer.hang = 0
    await rig.close(timeout=3.0)


async def test_s13_53_the_default_rpc_deadline_is_5s() -> None:
    """engine-events-and-subscriber.md §3.5 / §8: every RPC of the subscriber has a 5 s deadline; a
    client built without one (as ``Subscriber.start`` builds it) uses it."""
    assert RPC_DEADLINE == 5.0
    client = CacheClient(f"127.0.0.1:{free_port()}")  # lazy channel: nothing connects
    try:
        assert client.deadline == 5.0
    finally:
        await client.close()


def _hanging_reflection_server(hang: float) -> grpc.aio.Server:
    """A loopback server whose ``ServerReflectionInfo`` accepts the call and never answers
    within ``hang`` seconds."""

    async def info(request_iterator: Any, context: Any) -> Any:
        await asyncio.sleep(hang)
        yield b""

    srv = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "grpc.reflection.v1alpha.ServerReflection",
        {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(info)},
    ),))
    return srv


DEADLINE = 0.3


async def test_s13_53_every_client_call_fails_with_deadline_exceeded_against_a_hung_server(
    server: RecordingServer,
) -> None:
    """Each RPC method of ``CacheClient`` carries the client's deadline: against a server that
    accepts the call and hangs, it ends with DEADLINE_EXCEEDED after about the deadline (a
    shorter one than the 5 s default here, so the test is fast)."""
    public = {n for n, f in vars(CacheClient).items()
              if inspect.iscoroutinefunction(f) and not n.startswith("_") and n != "close"}
    assert public == {"report", "report_many", "publish", "supports_batched_evictions"}
    server.servicer.hang = 10.0
    client = CacheClient(server.address, deadline=DEADLINE)
    update = build_update(IDENT, [entry(1)], 5)
    calls: dict[str, Any] = {
        "report": lambda: client.report(update),
        "report_many": lambda: client.report_many([update, update]),
        "publish": lambda: client.publish(build_event(IDENT, PREFIX_EVICTED, 5, entry(1)[0])),
    }
    try:
        for name, call in calls.items():
            attempts = server.servicer.attempts
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call(), 5.0)  # the test's own bound
            elapsed = time.monotonic() - t0
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (name, err.value)
            assert DEADLINE * 0.9 <= elapsed < DEADLINE + 1.5, (name, elapsed)
            assert server.servicer.attempts == attempts + 1, name  # the server had the call
        assert server.servicer.log == []  # nothing got through
    finally:
        await client.close()

    # the reflection probe behind supports_batched_evictions is bounded the same way: a hung
    # reflection service makes it answer "no" (one hash per PublishEvent) after the deadline
    hung = _hanging_reflection_server(10.0)
    port = hung.add_insecure_port("127.0.0.1:0")
    await hung.start()
    client = CacheClient(f"127.0.0.1:{port}", deadline=DEADLINE)
    try:
        t0 = time.monotonic()
        assert await asyncio.wait_for(client.supports_batched_evictions(), 5.0) is False
        elapsed = time.monotonic() - t0
        assert DEADLINE * 0.9 <= elapsed < DEADLINE + 1.5, elapsed
    finally:
        await client.close()
        await hung.stop(grace=None)


async def test_s13_54_unreachable_server_never_blocks_the_caller() -> None:
    rig = Rig(f"127.0.0.1:{free_port()}", window=0.01)
    t0 = time.monotonic()
    for i in range(2000):
        rig.fwd.add_many([entry(i)], 1)  # synchronous, never awaits the network
    assert time.monotonic() - t0 < 1.0
    await asyncio.sleep(0.3)
    assert rig.value("adds_not_sent_total") >= 1
    await rig.close(timeout=2.0)


async def test_resync_after_failures_resends_state_at_ts_zero(server: RecordingServer) -> None:
    server.servicer.fail = True
    rig = Rig(server.address, window=0.01)
    rig.state = [(entry(i)[0], 16, "a" if i % 2 else "", GPU_ONLY) for i in range(5)]
    rig.fwd.add_many([entry(100)], 1)
    await asyncio.sleep(0.2)
    assert rig.value("rpc_failures_total", rpc="ReportCacheState") >= 1
    server.servicer.fail = False
    await server.servicer.wait_for(lambda: len(server.servicer.prefixes()) >= 5)
    u = server.servicer.updates()[0]
    assert u.timestamp_us == 0
    assert {(p.prefix_hash, p.adapter_id, p.tier) for p in u.prefixes} == {
        (entry(i)[0], "a" if i % 2 else "", T1) for i in range(5)}
    await eventually(lambda: rig.value("resyncs_total") == 1)
    assert rig.value("resync_entries_total") == 5
    await rig.close()


async def test_resync_after_a_lost_removal_clears_first(
    server: RecordingServer, batch: bool,
) -> None:
    server.servicer.fail = True
    rig = Rig(server.address, batch_evictions=batch, window=0.01)
    rig.state = [(entry(1)[0], 16, "", GPU_ONLY)]
    rig.fwd.evict(entry(9)[0], "", 3)
    await asyncio.sleep(0.15)
    server.servicer.fail = False
    await server.servicer.wait_for(lambda: server.servicer.updates())
    assert server.servicer.kinds()[:2] == ["ALL_CLEARED", "update"]
    assert server.servicer.events()[0].type == ALL_CLEARED
    await rig.close()


async def test_queued_removals_survive_a_resync(server: RecordingServer, batch: bool) -> None:
    rig = Rig(server.address, batch_evictions=batch, window=60.0)
    rig.state = [(entry(1)[0], 16, "", GPU_ONLY)]
    rig.fwd.request_resync()
    rig.fwd.evict(entry(9)[0], "", 3)
    await server.servicer.wait_for(lambda: len(server.servicer.log) >= 2)
    assert server.servicer.kinds() == ["PREFIX_EVICTED", "update"]
    assert server.servicer.events()[0].type == PREFIX_EVICTED
    await rig.close()


async def test_full_send_queue_drops_adds_and_resyncs_later(server: RecordingServer) -> None:
    server.servicer.hang = 0.3
    rig = Rig(server.address, window=60.0, max_pending=10, max_queued_entries=20)
    rig.state = [(entry(i)[0], 16, "", GPU_ONLY) for i in range(3)]
    for i in range(100):
        rig.fwd.add_many([entry(i)], 1)
    assert rig.value("adds_not_sent_total") >= 70
    server.servicer.hang = 0
    await server.servicer.wait_for(lambda: rig.value("resyncs_total") >= 1)
    await rig.close()


async def test_s13_resync_when_the_server_restarts_while_quiet() -> None:
    """Trigger (2): the channel is lost and back with no RPC failing in between."""
    port = free_port()
    first = await RecordingServer(port).start()
    rig = Rig(f"127.0.0.1:{port}", window=0.01)
    watcher = asyncio.create_task(watch_connectivity(rig.client.channel,
                                                     rig.fwd.request_resync))
    rig.state = [(entry(1)[0], 16, "", GPU_ONLY), (entry(2)[0], 32, "", GPU_ONLY)]
    rig.fwd.add_many([entry(1), entry(2)], 1)
    await first.servicer.wait_for(lambda: first.servicer.updates())
    await first.stop()
    await asyncio.sleep(0.3)
    second = await RecordingServer(port).start()
    try:
        await second.servicer.wait_for(lambda: len(second.servicer.prefixes()) == 2, timeout=5.0)
        assert second.servicer.updates()[0].timestamp_us == 0
        await eventually(lambda: rig.value("resyncs_total") == 1)
        assert rig.value("rpc_failures_total", rpc="ReportCacheState") == 0
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await rig.close()
        await second.stop()


def _apply(state: dict[tuple[bytes, str], int], log: list[tuple[str, Any, float]]) -> None:
    """The server's effect (contract-and-index.md §4.2, §4.4) of what it received, in arrival
    order."""
    for kind, msg, _ in log:
        if kind == "update":
            for p in msg.prefixes:
                state[(p.prefix_hash, p.adapter_id)] = p.tier
        elif msg.type == PREFIX_EVICTED:
            for key in [k for k in state if k[0] == msg.prefix_hash
                        and (not msg.adapter_id or k[1] == msg.adapter_id)]:
                del state[key]
        elif msg.type == ALL_CLEARED:
            state.clear()


async def test_reordered_runs_reach_the_same_final_state_as_strict_order(
    server: RecordingServer, batch: bool,
) -> None:
    """Adds and evictions are merged into "one update, then evictions" only where that cannot
    change the result: the server ends in the state the strict spec order gives."""
    import random

    for seed in range(25):
        rng = random.Random(seed)
        server.servicer.log.clear()
        rig = Rig(server.address, batch_evictions=batch, window=60.0)
        expected: dict[tuple[bytes, str], int] = {}
        for _ in range(rng.randint(5, 60)):
            prefix = rng.randrange(6).to_bytes(8, "big")
            adapter = rng.choice(["", "", "a", "b"])
            op = rng.random()
            if op < 0.5:
                tier = rng.choice([T1, T2])
                rig.fwd.add_many([(prefix, 16, adapter, tier)], 1)
                expected[(prefix, adapter)] = tier
            elif op < 0.9:
                rig.fwd.flush()  # the mapper flushes before every removal
                rig.fwd.evict(prefix, adapter, 1)
                for key in [k for k in expected if k[0] == prefix and (not adapter
                                                                      or k[1] == adapter)]:
                    del expected[key]
            elif op < 0.95:
                rig.fwd.flush()
                rig.fwd.report([(prefix, 16, adapter, T2)], 1)
                expected[(prefix, adapter)] = T2
            else:
                rig.fwd.clear(1)
                expected.clear()
        await rig.close()
        got: dict[tuple[bytes, str], int] = {}
        _apply(got, server.servicer.log)
        assert got == expected, seed


async def test_full_cache_pattern_needs_few_round_trips(
    server: RecordingServer, batch: bool,
) -> None:
    rig = Rig(server.address, batch_evictions=batch, window=60.0)
    for i in range(50):  # evict an old block, store a new one (a full engine cache)
        rig.fwd.flush()
        rig.fwd.evict(entry(1000 + i)[0], "", 1)
        rig.fwd.add_many([entry(i)], 1)
    await rig.close()
    assert len(server.servicer.prefixes()) == 50 and len(server.servicer.events()) == 50
    assert server.servicer.streams <= 3  # not one update per stored block


# ---- batched evictions (--batch-evictions, additive field 8) ---------------------------------


async def test_evictions_of_one_adapter_and_ts_go_out_as_one_publish(
    server: RecordingServer, batch: bool
) -> None:
    rig = Rig(server.address, batch_evictions=batch, window=60.0)
    plan = [(entry(i)[0], "", 7) for i in range(5)] + [(entry(i)[0], "a", 7) for i in (5, 6)] + [
        (entry(7)[0], "", 8)]
    for prefix, adapter, ts in plan:
        rig.fwd.evict(prefix, adapter, ts)
    await rig.close()
    calls = server.servicer.publish_calls()
    got = {(c.adapter_id, c.timestamp_us): [c.prefix_hash, *c.prefix_hashes] for c in calls}
    if batch:
        assert len(calls) == 3
        assert got == {("", 7): [entry(i)[0] for i in range(5)],
                       ("a", 7): [entry(5)[0], entry(6)[0]], ("", 8): [entry(7)[0]]}
    else:
        assert len(calls) == 8 and not any(c.prefix_hashes for c in calls)
    # what the server applies, per block, is the same in both modes
    logical = sorted((e.prefix_hash, e.adapter_id, e.timestamp_us)
                     for e in server.servicer.events())
    assert logical == sorted(plan)
    assert all((e.replica_id, e.model_id, e.tenant_id) == ("replica-a", "model-x", "tenant-t")
               for e in calls)
    assert rig.value("evictions_total") == 8


async def test_a_batch_is_bounded(server: RecordingServer) -> None:
    from inferencecache.subscriber.forwarder import MAX_EVICTION_BATCH

    rig = Rig(server.address, window=60.0)
    n = MAX_EVICTION_BATCH + 10
    for i in range(n):
        rig.fwd.evict(entry(i)[0], "", 1)
    await rig.close()
    sizes = sorted(1 + len(c.prefix_hashes) for c in server.servicer.publish_calls())
    assert sizes == [10, MAX_EVICTION_BATCH]
    assert len(server.servicer.events()) == n


async def test_batched_resync_keeps_clears_in_place(server: RecordingServer) -> None:
    rig = Rig(server.address, window=60.0)
    rig.state = [(entry(1)[0], 16, "", GPU_ONLY)]
    rig.fwd.request_resync()
    rig.fwd.evict(entry(7)[0], "", 3)
    rig.fwd.evict(entry(8)[0], "", 3)
    rig.fwd.clear(4)
    rig.fwd.evict(entry(9)[0], "", 5)
    await server.servicer.wait_for(lambda: len(server.servicer.rpcs) >= 4)
    assert [(k, m.type if k == "event" else None) for k, m in server.servicer.rpcs] == [
        ("event", PREFIX_EVICTED), ("event", ALL_CLEARED), ("event", PREFIX_EVICTED),
        ("update", None)]
    first = server.servicer.rpcs[0][1]
    assert [first.prefix_hash, *first.prefix_hashes] == [entry(7)[0], entry(8)[0]]
    await rig.close()


async def test_a_failed_batched_publish_counts_every_block(server: RecordingServer) -> None:
    server.servicer.fail = True
    rig = Rig(server.address, window=60.0)
    for i in range(6):
        rig.fwd.evict(entry(i)[0], "", 1)
    await eventually(lambda: rig.value("rpc_failures_total", rpc="PublishEvent") >= 1)
    assert rig.value("events_not_sent_total") == 6
    assert rig.value("rpc_failures_total", rpc="PublishEvent") == 1
    server.servicer.fail = False
    await rig.close()


async def test_a_backlog_of_updates_shares_one_stream_in_order(server: RecordingServer) -> None:
    """Queued flushes go out as bounded updates (≤ max_pending each), in order, on one stream."""
    rig = Rig(server.address, window=60.0, max_pending=10)
    server.servicer.hang = 0.2  # the first stream is slow: the rest queues behind it
    rig.fwd.add_many([entry(0)], 1)
    rig.fwd.flush()
    await asyncio.sleep(0.05)
    server.servicer.hang = 0
    for i in range(1, 36):
        rig.fwd.add_many([entry(i)], 100 + i)
        if i % 5 == 0:
            rig.fwd.flush()
    await rig.close()
    ups = server.servicer.updates()
    assert [p[0] for p in server.servicer.prefixes()] == [entry(i)[0].hex() for i in range(36)]
    assert all(len(u.prefixes) <= 10 for u in ups)
    assert server.servicer.streams < len(ups)  # several updates on one stream
    assert [u.timestamp_us for u in ups][1:] == [110, 120, 130, 135]  # last ts of each merge
