"""The refresher: resident blocks re-reported once per cycle, evenly, never after their eviction,
only while the engine is alive (subscriber/refresh.py; issue 11 item 1).

The pacer and the liveness rule take ``now`` from the caller, so these tests step simulated time;
the wire-order tests run the mapper, the real forwarder and a real gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
from typing import Any

import pytest

from inferencecache.kvevents import decode_batch
from inferencecache.kvevents.encode import WireEvent, WireRemoved, WireStored, encode_batch
from inferencecache.subscriber.client import CacheClient
from inferencecache.subscriber.forwarder import Forwarder
from inferencecache.subscriber.lora import LoraResolver
from inferencecache.subscriber.mapping import BlockMapper
from inferencecache.subscriber.messages import PREFIX_EVICTED, Identity
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.refresh import (
    PAUSED_RECHECK,
    EngineLiveness,
    RefreshPacer,
    refresh_step,
    run_refresher,
)
from inferencecache.subscriber.tiers import T1, T2
from tests.subscriber.conftest import MapperKit
from tests.subscriber.recorder import RecordingServer

TS = 1767225600.125
IDENT = Identity("r0", "m", "default", "vllm")


def run(mapper: BlockMapper, *events: WireEvent) -> None:
    mapper.apply(decode_batch(encode_batch(TS, list(events), "vllm-0.33")))


def store(first: int, n: int, parent: int | None = None, **kw: Any) -> WireStored:
    """``n`` chained blocks with engine hashes ``first..first+n-1`` (16 tokens each)."""
    kw.setdefault("medium", "GPU")
    tokens = [(first * 7 + i) % 50_000 for i in range(16 * n)]
    return WireStored(list(range(first, first + n)), parent, tokens, 16, **kw)


def fill(kit: MapperKit, blocks: int, chain: int = 8) -> None:
    for first in range(1000, 1000 + blocks, chain):
        run(kit.mapper, store(first, min(chain, 1000 + blocks - first)))
    kit.outbox.take()


def refreshed(kit: MapperKit) -> list[bytes]:
    return [e[0] for c in kit.outbox.take() if c[0] == "refresh" for e in c[1]]


def resident_prefixes(kit: MapperKit) -> set[bytes]:
    return {b[0] for g in kit.mapper.snapshot() for b in g}


# ---- the pacer --------------------------------------------------------------------------------


def test_every_resident_block_once_per_cycle_evenly_spread(kit: MapperKit) -> None:
    fill(kit, 2000)
    pacer = RefreshPacer(100.0, min_batch=50, min_tick=1.0)
    now, seen, per_tick = 0.0, [], []
    pacer.tick(now, kit.mapper)  # the first cycle's snapshot is taken here
    while now < 100.0:
        now = pacer.next_due(now)
        assert now >= 0  # next_due never goes back
        pacer.tick(now, kit.mapper)
        got = refreshed(kit)
        per_tick.append((now, len(got)))
        seen += got
    assert sorted(seen) == sorted(resident_prefixes(kit))  # each block exactly once
    assert pacer.cycles == 1 and pacer.emitted == 2000
    # Evenly: slices of min_batch (50) at ~2.5 s steps, never a burst of the whole set.
    sizes = [n for _, n in per_tick if n]
    assert max(sizes) <= 51 and len(sizes) >= 39
    times = [t for t, n in per_tick if n]
    assert all(b - a >= 1.0 - 1e-9 for a, b in itertools.pairwise(times))


def test_small_sets_go_out_once_per_cycle_at_its_end(kit: MapperKit) -> None:
    fill(kit, 10)
    pacer = RefreshPacer(60.0)  # default min_batch 256 > 10 blocks
    pacer.tick(0.0, kit.mapper)
    assert pacer.next_due(0.0) == 60.0
    pacer.tick(30.0, kit.mapper)
    assert refreshed(kit) == []
    pacer.tick(60.0, kit.mapper)
    assert len(refreshed(kit)) == 10
    assert pacer.next_due(60.0) == 120.0  # the next cycle started with a new snapshot


def test_an_evicted_block_is_never_refreshed_and_changes_are_read_at_refresh_time(
    kit: MapperKit,
) -> None:
    fill(kit, 16)
    pacer = RefreshPacer(10.0, min_batch=1)
    pacer.tick(0.0, kit.mapper)  # snapshot of 16 blocks
    evicted = kit.mapper.lookup((1003).to_bytes(8, "big"))
    assert evicted is not None
    run(kit.mapper, WireRemoved([1003], medium="GPU"))
    # A CPU copy of block 1005 appears and the GPU copy goes: the block is now T2.
    run(kit.mapper, WireStored([1005], None, [], 0, medium="CPU"),
        WireRemoved([1005], medium="GPU"))
    kit.outbox.take()
    pacer.tick(10.0, kit.mapper)
    got = [e for c in kit.outbox.take() if c[0] == "refresh" for e in c[1]]
    assert len(got) == 15 and evicted[0] not in {e[0] for e in got}
    tiers = {e[0]: e[3] for e in got}
    moved = kit.mapper.lookup((1005).to_bytes(8, "big"))
    assert moved is not None and tiers[moved[0]] == T2
    assert sum(t == T1 for t in tiers.values()) == 14


def test_blocks_wait_at_most_two_cycles_between_reports(kit: MapperKit) -> None:
    """Random stores and evictions over many cycles: a resident block is re-reported (or
    re-stored) at most ~2 intervals + one tick after its previous report."""
    rng = random.Random(5)
    interval, tick = 20.0, 1.0
    pacer = RefreshPacer(interval, min_batch=4, min_tick=tick)
    last: dict[bytes, float] = {}
    now, nxt, first = 0.0, 0, 10_000
    worst = 0.0
    while now < 12 * interval:
        if rng.random() < 0.6:
            run(kit.mapper, store(first + nxt * 4, 4))
            nxt += 1
        if rng.random() < 0.3 and nxt:
            victim = first + rng.randrange(nxt) * 4 + rng.randrange(4)
            run(kit.mapper, WireRemoved([victim], medium="GPU"))
        for c in kit.outbox.take():
            if c[0] in ("add", "refresh"):
                for e in c[1]:
                    last[e[0]] = now
        alive = resident_prefixes(kit)
        for p in alive:
            worst = max(worst, now - last[p])
        for p in set(last) - alive:
            del last[p]
        _, due = refresh_step(pacer, kit.mapper, EngineLiveness(1.0), now)
        now = min(due, now + rng.uniform(0.2, 1.5))
    assert pacer.cycles >= 8
    assert worst <= 2 * interval + 2 * tick


def test_a_dead_engine_pauses_the_cycle_and_it_resumes_without_a_burst(kit: MapperKit) -> None:
    fill(kit, 1000)
    pacer = RefreshPacer(100.0, min_batch=10)
    pacer.tick(0.0, kit.mapper)
    pacer.tick(50.0, kit.mapper)
    assert len(refreshed(kit)) == 500
    for t in range(51, 500):  # the engine is dead for 450 s
        assert pacer.tick(float(t), kit.mapper, alive=False) == 0
    assert refreshed(kit) == []
    # Alive again: it carries on from where it stopped, at the cycle's pace.
    pacer.tick(500.0, kit.mapper)
    pacer.tick(501.0, kit.mapper)
    assert len(refreshed(kit)) <= 20
    assert pacer.position[0] <= 520


def test_liveness_rules() -> None:
    connected = [True]
    event: list[float | None] = [None]
    live = EngineLiveness(3.0, connected=lambda: connected[0], last_event=lambda: event[0])
    assert live.alive(100.0)  # no probe has ever answered: the connection decides
    connected[0] = False
    assert not live.alive(100.0)
    connected[0] = True
    live.probe_ok(100.0)
    assert live.alive(103.0) and not live.alive(103.5)  # probes used to answer, now silent
    event[0] = 103.2  # an engine event is proof of life too
    assert live.alive(106.0) and not live.alive(106.5)
    live.probe_ok(110.0)
    assert live.alive(112.0)
    connected[0] = False
    assert not live.alive(112.0)  # a closed socket wins over a recent answer


def test_refresh_step_rechecks_a_dead_engine_without_touching_the_cycle(kit: MapperKit) -> None:
    fill(kit, 300)
    pacer = RefreshPacer(30.0, min_batch=10)
    live = EngineLiveness(2.0)
    live.probe_ok(0.0)
    assert refresh_step(pacer, kit.mapper, live, 0.0)[0]
    alive, due = refresh_step(pacer, kit.mapper, live, 5.0)
    assert not alive and due == 5.0 + PAUSED_RECHECK and refreshed(kit) == []


def test_bad_intervals_are_rejected() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="refresh interval"):
            RefreshPacer(bad)


# ---- through the forwarder to a real server --------------------------------------------------


class Wire:
    """Mapper → real forwarder → ``server``."""

    def __init__(self, address: str, window: float = 0.02) -> None:
        self.metrics = SubscriberMetrics()
        self.client = CacheClient(address)
        self.mapper: BlockMapper | None = None
        self.fwd = Forwarder(self.client, IDENT, self.metrics, window=window,
                             snapshot=lambda: self.m.snapshot(), batch_evictions=True)
        self.mapper = BlockMapper(block_size=16, resolver=LoraResolver({}, True),
                                  outbox=self.fwd, metrics=self.metrics)
        self.task = asyncio.create_task(self.fwd.run())

    @property
    def m(self) -> BlockMapper:
        assert self.mapper is not None
        return self.mapper

    async def close(self) -> None:
        self.fwd.close()
        try:
            await asyncio.wait_for(self.task, 5.0)
        finally:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
            await self.client.close()


async def test_refresh_goes_in_order_with_evictions_as_plain_entries_at_now(
    server: RecordingServer,
) -> None:
    w = Wire(server.address, window=60.0)  # nothing leaves by the timer: order is the queue's
    try:
        run(w.m, store(1, 4))
        w.fwd.flush()
        await server.servicer.wait_for(lambda: len(server.servicer.updates()) == 1)
        stored = [p.prefix_hash for p in server.servicer.updates()[0].prefixes]
        pacer = RefreshPacer(10.0, min_batch=1)
        pacer.tick(0.0, w.m)
        pacer.tick(10.0, w.m)  # all four blocks re-reported (pending)...
        run(w.m, WireRemoved([3], medium="GPU"))  # ...then the engine evicts one
        await server.servicer.wait_for(lambda: len(server.servicer.log) >= 3)
        kinds = server.servicer.kinds()
        assert kinds == ["update", "update", "PREFIX_EVICTED"], kinds
        refresh = server.servicer.updates()[1]
        assert refresh.timestamp_us == 0  # "now" at the server
        assert [p.prefix_hash for p in refresh.prefixes] == stored
        assert all(p.adapter_id == "" and p.tier == T1 for p in refresh.prefixes)
        ev = server.servicer.events()[0]
        assert ev.type == PREFIX_EVICTED and ev.prefix_hash == stored[2]
        # The evicted block is never refreshed again (two more cycles; the first one's snapshot
        # was taken before the eviction).
        pacer.tick(20.0, w.m)
        pacer.tick(30.0, w.m)
        w.fwd.flush()
        await server.servicer.wait_for(lambda: len(server.servicer.updates()) == 3)
        again = [p.prefix_hash for p in server.servicer.updates()[2].prefixes]
        assert sorted(again) == sorted(2 * (stored[:2] + stored[3:]))
        v = w.metrics.registry.get_sample_value("inferencecache_subscriber_refresh_entries_total")
        assert v == 4 + 3 + 3
    finally:
        await w.close()


async def test_no_refresh_while_a_resync_is_pending(server: RecordingServer) -> None:
    w = Wire(server.address)
    try:
        run(w.m, store(1, 3))
        await server.servicer.wait_for(lambda: len(server.servicer.updates()) == 1)
        server.servicer.fail = True
        w.m.outbox.refresh([(b"\x00" * 8, 16, "", T1)])

        def failures() -> float | None:
            return w.metrics.registry.get_sample_value(
                "inferencecache_subscriber_rpc_failures_total", {"rpc": "ReportCacheState"})

        await server.servicer.wait_for(lambda: (failures() or 0) >= 1)  # a resync is due now
        before = w.metrics.registry.get_sample_value(
            "inferencecache_subscriber_refresh_entries_total")
        w.m.outbox.refresh([(b"\x01" * 8, 16, "", T1)])
        after = w.metrics.registry.get_sample_value(
            "inferencecache_subscriber_refresh_entries_total")
        assert after == before  # dropped silently: the resync re-sends the resident set
        server.servicer.fail = False
        await server.servicer.wait_for(
            lambda: w.metrics.registry.get_sample_value(
                "inferencecache_subscriber_resyncs_total") == 1, timeout=10)
        assert b"\x01" * 8 not in {p.prefix_hash for u in server.servicer.updates()
                                   for p in u.prefixes}
    finally:
        await w.close()


async def test_run_refresher_ticks_on_its_own_and_reports_pauses(kit: MapperKit) -> None:
    fill(kit, 40)
    pacer = RefreshPacer(0.2, min_batch=1, min_tick=0.01)
    alive = [True]
    flips: list[bool] = []

    class Flip(EngineLiveness):
        def alive(self, now: float) -> bool:
            return alive[0]

    task = asyncio.create_task(run_refresher(pacer, kit.mapper, Flip(1.0),
                                             on_pause=flips.append))
    try:
        for _ in range(200):
            if pacer.emitted >= 80:
                break
            await asyncio.sleep(0.01)
        assert pacer.emitted >= 80  # two cycles of 40
        alive[0] = False
        await asyncio.sleep(0.05)
        emitted = pacer.emitted
        await asyncio.sleep(0.3)
        assert pacer.emitted == emitted
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert flips == [False, True]
