"""Differential test: random operation sequences on the compiled store and on the pure-Python
twin ``MemStore`` must give the same result for every call and the same holds after each step.

The key pool mixes 8-byte keys (sequential, structured and random-looking) with keys of other
lengths (empty, 1..7, 9, 256 bytes, 8-byte keys' prefixes and extensions), so slots with
inline keys and side-table keys share clusters. Timestamps come from a narrow range so
freshness boundaries and eviction ties are hit often.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferencecache.index.memstore import MemStore
from inferencecache.index.store import PartitionOps

from ._native import BLOCKMAP

pytestmark = pytest.mark.skipif(BLOCKMAP is None, reason="C accelerator not built")


def _pool() -> list[bytes]:
    eight = [struct.pack("<Q", i) for i in range(12)]  # sequential values
    eight += [struct.pack(">Q", i << 40) for i in range(1, 5)]  # structured high bits
    eight += [bytes([i]) * 8 for i in range(200, 204)]
    odd = [b"", b"\x00", b"\x00" * 7, b"\x00" * 9, bytes(range(256)), bytes(range(255))]
    odd += [eight[1][:4], eight[1] + b"\x00", eight[2] + b"tail", eight[13][:7]]
    return eight + odd


POOL = _pool()
EIGHT = [k for k in POOL if len(k) == 8]
I32 = st.integers(-(2**31), 2**31 - 1)
TOKENS = st.one_of(st.integers(-5, 100), I32)
COUNT = st.one_of(st.integers(-3, 64), st.integers(-(2**40), 2**40))
TIME = st.integers(0, 20)
TIER = st.one_of(st.sampled_from([1, 2, 3, 2**31 - 1]), st.integers(4, 2**31 - 1))
REPLICA = st.one_of(st.integers(0, 5), st.just(2**32 - 2))
KEY = st.sampled_from(POOL)
CHAIN = st.lists(KEY, min_size=0, max_size=24)
CHAIN8 = st.lists(st.sampled_from(EIGHT), min_size=0, max_size=24)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        assert BLOCKMAP is not None
        self.native: Any = BLOCKMAP.BlockMap()
        self.ref = PartitionOps(MemStore())

    @initialize(
        chains=st.lists(
            st.tuples(st.lists(KEY, min_size=1, max_size=30), REPLICA, TIME, TIER), max_size=4
        ),
        tune=st.sampled_from([(1, 1), (2, 2), (16384, 16)]),
    )
    def seed(self, chains: list[tuple[list[bytes], int, int, int]], tune: tuple[int, int]) -> None:
        self.native._tune_candidates(*tune)  # small caches exercise the threshold paths
        for keys, replica, ts, tier in chains:
            tokens = list(range(1, len(keys) + 1))
            a = self.native.upsert_many(keys, tokens, replica, ts, tier)
            assert a == self.ref.upsert_many(keys, tokens, replica, ts, tier)

    @rule(key=KEY, replica=REPLICA, tokens=TOKENS, ts=TIME, tier=TIER)
    def upsert(self, key: bytes, replica: int, tokens: int, ts: int, tier: int) -> None:
        a = self.native.upsert(key, replica, tokens, ts, tier)
        assert a == self.ref.upsert(key, replica, tokens, ts, tier)

    @rule(keys=CHAIN, data=st.data(), replica=REPLICA, ts=TIME, tier=TIER)
    def upsert_many(
        self, keys: list[bytes], data: st.DataObject, replica: int, ts: int, tier: int
    ) -> None:
        tokens = data.draw(st.lists(TOKENS, min_size=len(keys), max_size=len(keys)))
        a = self.native.upsert_many(keys, tokens, replica, ts, tier)
        assert a == self.ref.upsert_many(keys, tokens, replica, ts, tier)

    @rule(key=KEY, replica=REPLICA)
    def remove_hold(self, key: bytes, replica: int) -> None:
        assert self.native.remove_hold(key, replica) == self.ref.remove_hold(key, replica)

    @rule(replica=REPLICA)
    def remove_replica(self, replica: int) -> None:
        assert self.native.remove_replica(replica) == self.ref.remove_replica(replica)

    @rule(key=KEY)
    def remove_key(self, key: bytes) -> None:
        assert sorted(self.native.remove_key(key)) == sorted(self.ref.remove_key(key))

    @rule(t=st.integers(-1, 21))
    def sweep(self, t: int) -> None:
        assert self.native.sweep(t) == self.ref.sweep(t)

    @rule(keys=CHAIN, data=st.data(), replica=REPLICA, packed=st.booleans())
    def credit(self, keys: list[bytes], data: st.DataObject, replica: int, packed: bool) -> None:
        blocks = data.draw(st.integers(0, len(keys)))  # the twin indexes keys[:blocks]
        if packed and all(len(k) == 8 for k in keys):
            self.native.credit(b"".join(keys), blocks, replica)
        else:
            self.native.credit(keys, blocks, replica)
        self.ref.credit(keys, blocks, replica)

    @rule(keys=CHAIN, data=st.data(), fresh_after=st.integers(-1, 21))
    def walk(self, keys: list[bytes], data: st.DataObject, fresh_after: int) -> None:
        counts = data.draw(st.lists(COUNT, min_size=len(keys), max_size=len(keys)))
        want = sorted(self.ref.walk(keys, counts, fresh_after))
        assert sorted(self.native.walk(keys, counts, fresh_after)) == want

    @rule(keys=CHAIN8, data=st.data(), fresh_after=st.integers(-1, 21))
    def walk_packed(self, keys: list[bytes], data: st.DataObject, fresh_after: int) -> None:
        counts = data.draw(st.lists(COUNT, min_size=len(keys), max_size=len(keys)))
        packed = b"".join(keys)
        want = sorted(self.ref.walk(packed, counts, fresh_after))
        assert sorted(self.native.walk(packed, counts, fresh_after)) == want
        assert sorted(self.native.walk(keys, counts, fresh_after)) == want

    @rule(data=st.data(), fresh_after=st.integers(-1, 21))
    def walk_existing_chain(self, data: st.DataObject, fresh_after: int) -> None:
        """Walk a chain made of stored keys so long runs and many replicas are exercised."""
        stored = sorted({h.key for h in self.ref.holds()})
        if not stored:
            return
        keys = data.draw(st.lists(st.sampled_from(stored), min_size=1, max_size=30))
        counts = data.draw(st.lists(COUNT, min_size=len(keys), max_size=len(keys)))
        want = sorted(self.ref.walk(keys, counts, fresh_after))
        assert sorted(self.native.walk(keys, counts, fresh_after)) == want

    @rule(key=KEY, fresh_after=st.integers(-1, 21))
    def holders(self, key: bytes, fresh_after: int) -> None:
        a = sorted(self.native.holders(key, fresh_after))
        assert a == sorted(self.ref.holders(key, fresh_after))

    @rule(k=st.integers(-1, 40), lfu=st.booleans())
    def cap_candidates(self, k: int, lfu: bool) -> None:
        a = sorted(self.native.cap_candidates(k, lfu))
        assert a == sorted(self.ref.cap_candidates(k, lfu))

    @rule(k=st.integers(-1, 30))
    def quota_candidates(self, k: int) -> None:
        assert sorted(self.native.quota_candidates(k)) == sorted(self.ref.quota_candidates(k))

    @precondition(lambda self: self.ref.hold_count() > 0)
    @rule()
    def replica_summary(self) -> None:
        assert self.native.replica_summary() == self.ref.replica_summary()

    @invariant()
    def same_holds(self) -> None:
        assert sorted(self.native.holds()) == sorted(self.ref.holds())
        assert self.native.key_count() == self.ref.key_count()
        assert self.native.hold_count() == self.ref.hold_count()
        self.native.check_invariants()


StoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestStoreMachine = StoreMachine.TestCase


class BulkMachine(RuleBasedStateMachine):
    """Fewer, bigger steps: thousands of keys so the table grows, shrinks and compacts its
    overflow arena while replicas come and go."""

    def __init__(self) -> None:
        super().__init__()
        assert BLOCKMAP is not None
        self.native: Any = BLOCKMAP.BlockMap()
        self.ref = PartitionOps(MemStore())

    @rule(
        start=st.integers(0, 3000),
        n=st.integers(1, 3000),
        replica=st.integers(0, 7),
        ts=st.integers(0, 10),
    )
    def ingest(self, start: int, n: int, replica: int, ts: int) -> None:
        keys = [struct.pack("<Q", start + i) for i in range(n)]
        if start % 5 == 0:
            keys += [bytes(range(start % 40)) + b"x" * (i % 3) for i in range(20)]
        tokens = [16 * (i + 1) for i in range(len(keys))]
        a = self.native.upsert_many(keys, tokens, replica, ts, 1)
        assert a == self.ref.upsert_many(keys, tokens, replica, ts, 1)

    @rule(replica=st.integers(0, 7))
    def clear(self, replica: int) -> None:
        assert self.native.remove_replica(replica) == self.ref.remove_replica(replica)

    @rule(t=st.integers(-1, 10))
    def sweep(self, t: int) -> None:
        assert self.native.sweep(t) == self.ref.sweep(t)

    @rule(start=st.integers(0, 3000), fresh_after=st.integers(-1, 10))
    def walk(self, start: int, fresh_after: int) -> None:
        keys = b"".join(struct.pack("<Q", start + i) for i in range(512))
        counts = [16] * 512
        want = sorted(self.ref.walk(keys, counts, fresh_after))
        assert sorted(self.native.walk(keys, counts, fresh_after)) == want

    @rule(k=st.integers(1, 5000), lfu=st.booleans())
    def candidates(self, k: int, lfu: bool) -> None:
        assert sorted(self.native.cap_candidates(k, lfu)) == sorted(self.ref.cap_candidates(k, lfu))
        assert sorted(self.native.quota_candidates(k)) == sorted(self.ref.quota_candidates(k))

    @invariant()
    def same_holds(self) -> None:
        assert self.native.hold_count() == self.ref.hold_count()
        assert self.native.key_count() == self.ref.key_count()
        assert self.native.replica_summary() == self.ref.replica_summary()
        self.native.check_invariants()

    def teardown(self) -> None:
        assert sorted(self.native.holds()) == sorted(self.ref.holds())


BulkMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestBulkMachine = BulkMachine.TestCase


class EvictionMachine(RuleBasedStateMachine):
    """The index's global-cap and quota loops on one partition: ask for the k smallest holds
    (or keys), evict them in full order, keep ingesting (sometimes with old timestamps),
    crediting and removing. Exercises the candidate caches the compiled store keeps between
    cap_candidates / quota_candidates calls."""

    def __init__(self) -> None:
        super().__init__()
        assert BLOCKMAP is not None
        self.native: Any = BLOCKMAP.BlockMap()
        self.ref = PartitionOps(MemStore())
        self.now = 100

    @initialize(tune=st.sampled_from([(1, 1), (3, 2), (8, 4), (16384, 16)]), n=st.integers(1, 300))
    def seed(self, tune: tuple[int, int], n: int) -> None:
        self.native._tune_candidates(*tune)
        keys = [struct.pack("<Q", i) for i in range(n)] + [b"x" * (i % 12) for i in range(10)]
        for r in range(3):
            toks = list(range(len(keys)))
            self.native.upsert_many(keys[r::2], toks, r, self.now + r, 1)
            self.ref.upsert_many(keys[r::2], toks, r, self.now + r, 1)

    @rule(
        start=st.integers(0, 400),
        n=st.integers(1, 60),
        replica=st.integers(0, 4),
        back=st.one_of(st.just(0), st.integers(0, 150)),
    )
    def ingest(self, start: int, n: int, replica: int, back: int) -> None:
        self.now += 1
        ts = self.now - back  # an old timestamp now and then (producers' clocks are verbatim)
        keys = [struct.pack("<Q", start + i) for i in range(n)]
        toks = [1] * n
        assert self.native.upsert_many(keys, toks, replica, ts, 1) == self.ref.upsert_many(
            keys, toks, replica, ts, 1
        )

    @rule(start=st.integers(0, 400), n=st.integers(1, 40), replica=st.integers(0, 4))
    def credit(self, start: int, n: int, replica: int) -> None:
        keys = [struct.pack("<Q", start + i) for i in range(n)]
        self.native.credit(keys, n, replica)
        self.ref.credit(keys, n, replica)

    @rule(key=st.integers(0, 400), replica=st.integers(0, 4))
    def remove(self, key: int, replica: int) -> None:
        k = struct.pack("<Q", key)
        assert self.native.remove_hold(k, replica) == self.ref.remove_hold(k, replica)

    @rule(k=st.integers(1, 50), lfu=st.booleans(), evict=st.booleans())
    def cap(self, k: int, lfu: bool, evict: bool) -> None:
        got = sorted(self.native.cap_candidates(k, lfu))
        assert got == sorted(self.ref.cap_candidates(k, lfu))
        if evict:
            for _, _, key, replica in got[:k]:
                assert self.native.remove_hold(key, replica) == self.ref.remove_hold(key, replica)

    @rule(k=st.integers(1, 50), evict=st.booleans())
    def quota(self, k: int, evict: bool) -> None:
        got = sorted(self.native.quota_candidates(k))
        assert got == sorted(self.ref.quota_candidates(k))
        if evict:
            for _, key in got[:k]:
                assert sorted(self.native.remove_key(key)) == sorted(self.ref.remove_key(key))

    @rule(replica=st.integers(0, 4), sweep=st.booleans(), t=st.integers(0, 150))
    def mass_removal(self, replica: int, sweep: bool, t: int) -> None:
        if sweep:
            assert self.native.sweep(t) == self.ref.sweep(t)
        else:
            assert self.native.remove_replica(replica) == self.ref.remove_replica(replica)

    @invariant()
    def same_holds(self) -> None:
        assert self.native.hold_count() == self.ref.hold_count()
        self.native.check_invariants()

    def teardown(self) -> None:
        assert sorted(self.native.holds()) == sorted(self.ref.holds())


EvictionMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestEvictionMachine = EvictionMachine.TestCase
