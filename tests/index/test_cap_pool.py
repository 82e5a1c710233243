"""The global cap's candidate pool (eviction.CapPool) evicts exactly what a full sort would.

The pool computes many victims per scan and reuses them across ingests; this drives random
ingests (old and new timestamps, refreshes, two algorithms), LFU credits, removals and sweeps
through an index with a large pool and through one that rescans for every eviction, and demands
identical holds after every step (contract-and-index.md §6.3, items 77-79).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from inferencecache.index import eviction
from inferencecache.index.model import EventType
from inferencecache.index.settings import IndexSettings
from inferencecache.index.store import PartitionStore
from tests.index.support import TEST_POLICY, Env, h

TENANTS = ("t", "u")


def _run(
    store_factory: Callable[[], PartitionStore], pool_min: int, seed: int, steps: int
) -> list[dict[tuple[str, str, str, str, bytes, str], tuple[int, int, int, int]]]:
    old = eviction.POOL_MIN
    eviction.POOL_MIN = pool_min
    try:
        env = Env(store_factory, settings=IndexSettings(max_holds=40))
        env.policy("t", eviction="lfu")
        env.policy("u", base=TEST_POLICY)
        rng = random.Random(seed)
        seen: list[dict[tuple[str, str, str, str, bytes, str], tuple[int, int, int, int]]] = []
        for _ in range(steps):
            op = rng.random()
            tenant = rng.choice(TENANTS)
            replica = rng.choice(("r0", "r1", "r2"))
            if op < 0.55:
                n = rng.randint(1, 12)
                start = rng.randint(0, 60)
                keys = [h(start + i) for i in range(n)]
                env.clock.advance(rng.choice((0, 0.5, 3)))
                age = rng.choice((0, 0, 0, 10, 100, 2000))  # some older than the pool, some stale
                env.chain(replica, keys, 16, tenant_id=tenant, age=age)
            elif op < 0.8:
                start = rng.randint(0, 60)
                env.lookup([h(start + i) for i in range(rng.randint(1, 8))], tenant_id=tenant)
            elif op < 0.9:
                env.event(
                    EventType.PREFIX_EVICTED, replica, h(rng.randint(0, 70)), tenant_id=tenant
                )
            elif op < 0.95:
                env.clock.advance(rng.choice((60, 900)))
                env.index.sweep()
            else:
                env.event(EventType.ALL_CLEARED, replica, tenant_id=tenant)
            assert env.index.verify() == []
            seen.append(dict(env.holds()))
        env.close()
        return seen
    finally:
        eviction.POOL_MIN = old


@pytest.mark.parametrize("seed", range(6))
def test_c10_77_cap_pool_matches_full_rescan(
    store_factory: Callable[[], PartitionStore], seed: int
) -> None:
    exact = _run(store_factory, 1, seed, 250)
    pooled = _run(store_factory, 64, seed, 250)
    assert len(exact) == len(pooled)
    for i, (a, b) in enumerate(zip(exact, pooled, strict=True)):
        assert a == b, f"step {i} differs"
    # the cap was actually exercised
    assert max(len(s) for s in exact) <= 40 and any(len(s) == 40 for s in exact)
