"""The index's change feed (contract-and-index.md §13.1-§13.3) at the library level, on every
store backend: the ICB1 batch path reports what it applied, the feed costs nothing unobserved,
and an observer over its bound is cut off without touching ingest."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from inferencecache.index import batch
from inferencecache.index.changes import (
    ALL_CLEARED,
    PREFIX_ADDED,
    PREFIX_EVICTED,
    REPLICA_UPDATED,
    Change,
    Closed,
    Observer,
    Overflowed,
    Replaced,
)
from inferencecache.index.model import Stats
from inferencecache.index.settings import IndexSettings
from inferencecache.index.tenant_config import IndexConfig, TenantQuota
from tests.index.support import Env, h

T, M, S = "t", "m", "vllm"


def _flat(changes: list[Change]) -> list[tuple[int, str, str, bytes]]:
    out = []
    for c in changes:
        keys = list(c.each_hash()) or [b""]
        out += [(c.type, c.replica, c.adapter, k) for k in keys]
    return out


def _drain(obs: Observer) -> list[Change]:
    got: list[Change] = []
    while True:
        b = obs.next_batch(0)
        if not b:
            return got
        got.extend(b)


def test_c13_1_batch_apply_reports_every_record(env: Env) -> None:
    obs = env.index.observe()
    route = batch.Route(T, M, S, "lora", "r1")
    data = batch.encode([
        batch.Record(batch.STORE, route, tier=1, hashes=h(1) + h(2), tokens=[16, 32]),
        batch.Record(batch.STATS, route, stats=Stats(hit_rate=0.5)),
        batch.Record(batch.REMOVE, batch.Route(T, M, S, "", "r1"), hashes=h(2) + h(9)),
        batch.Record(batch.CLEAR, route),
    ])  # fmt: skip
    env.index.apply_batch(data)
    assert _flat(_drain(obs)) == [
        (PREFIX_ADDED, "r1", "lora", h(1)),
        (PREFIX_ADDED, "r1", "lora", h(2)),
        (REPLICA_UPDATED, "r1", "", b""),
        (PREFIX_EVICTED, "r1", "lora", h(2)),  # h(9) was not held: not reported
        (ALL_CLEARED, "r1", "", b""),
    ]
    obs.close()
    assert not env.index.feed.active
    # unobserved again: the compiled path, nothing collected
    env.index.apply_batch(data)
    assert env.index._state.changes is None


def test_c13_3_overflow_cuts_the_observer_off_and_ingest_goes_on(env: Env) -> None:
    slow = env.index.observe(max_backlog=2)
    fine = env.index.observe()
    for i in range(3):
        env.chain(f"r{i}", [h(i)])
    with pytest.raises(Overflowed):
        slow.next_batch(0)
    assert env.index.feed.count == 1 and env.index.feed.overflows == 1
    assert len(_drain(fine)) == 3
    assert env.index.counts()["holds"] == 3
    fine.close()
    with pytest.raises(Closed):
        fine.next_batch(0)


def test_c13_1_sweep_and_cap_report_removed_holds(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=IndexSettings(max_holds=2))
    env.chain("old", [h(1), h(2)], age=3600)  # past the 30 min default TTL
    obs = env.index.observe()
    env.chain("new", [h(3)])  # 3 holds > cap 2: the oldest goes
    got = _flat(_drain(obs))
    assert got[0] == (PREFIX_ADDED, "new", "", h(3))
    assert got[1][:2] == (PREFIX_EVICTED, "old") and got[1][3] in (h(1), h(2))
    env.index.sweep()
    swept = _flat(_drain(obs))
    assert swept == [(PREFIX_EVICTED, "old", "", ({h(1), h(2)} - {got[1][3]}).pop())]
    assert env.index.counts()["holds"] == 1


def test_c13_1_store_batches_report_in_order_with_quota_evictions(
    make_env: Callable[..., Env],
) -> None:
    """STORE-only batches keep the compiled applier when it is built (native store) and report
    the same changes, in the same order, as the reference does (python store)."""
    env = make_env(config=IndexConfig(quotas={T: TenantQuota(max_index_entries=2)}))
    obs = env.index.observe()
    data = batch.encode([
        batch.Record(batch.STORE, batch.Route(T, M, S, "", "r1"), timestamp_us=10, tier=1,
                     hashes=h(1) + h(2), tokens=[16, 32]),
        batch.Record(batch.STATS, batch.Route(T, M, S, "", "r1"), timestamp_us=11,
                     stats=Stats(hit_rate=0.5)),
        batch.Record(batch.STORE, batch.Route(T, M, S, "", "r2"), timestamp_us=12, tier=1,
                     hashes=h(3), tokens=[16]),
    ])  # fmt: skip
    env.index.apply_batch(data)
    got = [(c.type, c.replica, list(c.each_hash()), c.timestamp_us) for c in _drain(obs)]
    assert got[:3] == [
        (PREFIX_ADDED, "r1", [h(1), h(2)], 10),
        (REPLICA_UPDATED, "r1", [], 11),
        (PREFIX_ADDED, "r2", [h(3)], 12),
    ]
    # quota 2: the key whose newest hold is oldest (h(1) or h(2), both at 10) goes
    assert len(got) == 4 and got[3][:2] == (PREFIX_EVICTED, "r1")
    assert got[3][2][0] in (h(1), h(2))


def test_c13_3_state_replaced_cuts_observers_off(env: Env) -> None:
    obs = env.index.observe()
    env.chain("r", [h(1)])
    env.index.feed.state_replaced()  # what a snapshot load does (Index.replace_state)
    with pytest.raises(Replaced):
        obs.next_batch(0)
    assert not env.index.feed.active
