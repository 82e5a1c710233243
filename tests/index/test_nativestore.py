"""Edge cases of the compiled PartitionStore (``_blockmap.BlockMap``), each checked against the
pure-Python twin ``MemStore`` where the Protocol defines the answer."""

from __future__ import annotations

import gc
import os
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from inferencecache import accelerators
from inferencecache.index import store as store_mod
from inferencecache.index.memstore import MemStore
from inferencecache.index.store import Hold, PartitionOps, PartitionStore, Run

from ._native import BLOCKMAP

pytestmark = pytest.mark.skipif(BLOCKMAP is None, reason="C accelerator not built")

I32_MAX = 2**31 - 1
I32_MIN = -(2**31)


def new() -> Any:
    assert BLOCKMAP is not None
    return BLOCKMAP.BlockMap()


def k8(i: int) -> bytes:
    return struct.pack("<Q", i)


def both() -> tuple[Any, PartitionOps]:
    return new(), PartitionOps(MemStore())


def holds_of(s: PartitionStore) -> list[Hold]:
    return sorted(s.holds())


def runs_of(runs: list[Run]) -> list[Run]:
    return sorted(runs)


def same(a: PartitionStore, b: PartitionStore) -> None:
    assert holds_of(a) == holds_of(b)
    assert a.key_count() == b.key_count()
    assert a.hold_count() == b.hold_count()
    assert PartitionOps(a).replica_summary() == PartitionOps(b).replica_summary()


# ---------------------------------------------------------------------------------------------
# Shape of the module


def test_constants_equal_the_protocol_module() -> None:
    assert BLOCKMAP is not None
    assert BLOCKMAP.NEW_KEY == store_mod.NEW_KEY
    assert BLOCKMAP.NEW_HOLD == store_mod.NEW_HOLD
    assert BLOCKMAP.HOLD_REMOVED == store_mod.HOLD_REMOVED
    assert BLOCKMAP.KEY_REMOVED == store_mod.KEY_REMOVED
    assert BLOCKMAP.FAST_NAMEDTUPLES == 1  # Run/Hold are built in C without calling the class


def test_results_are_the_protocol_namedtuples() -> None:
    m = new()
    m.upsert(k8(1), 3, 10, 100, 1)
    (run,) = m.walk([k8(1)], [16], 0)
    assert type(run) is Run
    assert run == Run(replica=3, tokens=16, oldest=100, tier=1, blocks=1)
    assert run.blocks == 1 and run._asdict()["oldest"] == 100
    (hold,) = list(m.holds())
    assert type(hold) is Hold
    assert hold == Hold(key=k8(1), replica=3, tokens=10, last_seen=100, tier=1, access=0)


def test_nativestore_module_exposes_the_type() -> None:
    if accelerators.pure_python_forced():
        pytest.skip("nativestore is disabled by INFERENCECACHE_PURE_PYTHON (tested below)")
    from inferencecache.index import nativestore

    assert nativestore.NativeStore is nativestore.BlockMap
    assert BLOCKMAP is not None
    assert nativestore.NativeStore is BLOCKMAP.BlockMap


def test_nativestore_import_fails_cleanly_when_pure_python_is_forced() -> None:
    env = dict(os.environ, INFERENCECACHE_PURE_PYTHON="1")
    env.pop("INFERENCECACHE_REQUIRE_NATIVE", None)
    code = (
        "import sys\n"
        "try:\n"
        "    import inferencecache.index.nativestore\n"
        "except ImportError as e:\n"
        "    print('ImportError', e)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "INFERENCECACHE_PURE_PYTHON" in out.stdout


def test_keyword_arguments_follow_the_protocol_names() -> None:
    m = new()
    assert m.upsert(key=k8(1), replica=0, tokens=5, last_seen=10, tier=2) == 3
    assert m.upsert_many(keys=[k8(2)], tokens=[6], replica=0, last_seen=10, tier=1) == (1, 1)
    assert m.holders(key=k8(1), fresh_after=0) == [(0, 5, 10, 2)]
    assert m.walk(keys=[k8(1)], counts=[4], fresh_after=0) == [Run(0, 4, 10, 2, 1)]
    m.credit(keys=[k8(1)], blocks=1, replica=0)
    assert m.cap_candidates(k=1, lfu=True) == [(0, 10, k8(2), 0)]
    assert m.quota_candidates(k=5) and m.sweep(stale_at_or_before=0) == ({}, 0)
    assert m.remove_hold(key=k8(1), replica=0) == 3
    assert m.remove_key(key=k8(2)) == [0]
    assert m.remove_replica(replica=0) == (0, 0)
    with pytest.raises(TypeError):
        m.upsert(k8(1), 0, 5, 10)  # missing tier
    with pytest.raises(TypeError):
        m.holders(k8(1), 0, fresh=1)


# ---------------------------------------------------------------------------------------------
# Keys: exact bytes of any length


ODD_KEYS = [
    b"",
    b"\x00",
    b"abcd",
    b"\x00" * 7,
    b"\x00" * 9,
    b"abcdefgh"[:7],
    b"abcdefgh" + b"i",
    bytes(range(16)),
    bytes(range(256)),
    bytes(255 - i for i in range(256)),
]


def test_keys_of_any_length_are_exact_and_distinct() -> None:
    m, ref = both()
    keys = [*ODD_KEYS, b"abcdefgh", b"\x00" * 8]
    for i, key in enumerate(keys):
        for s in (m, ref):
            assert s.upsert(key, 1, i, 1000 + i, 1) == 3
    same(m, ref)
    for i, key in enumerate(keys):
        assert m.holders(key, 0) == [(1, i, 1000 + i, 1)]
    # an 8-byte key that is a prefix of a longer key, and longer keys sharing 8-byte prefixes
    assert m.holders(b"abcdefgh", 0) == [(1, len(keys) - 2, 1000 + len(keys) - 2, 1)]
    assert m.holders(b"abcdefghj", 0) == []
    assert m.holders(bytes(range(255)), 0) == []
    m.check_invariants()
    for key in keys:
        assert m.remove_hold(key, 1) == 3
        m.check_invariants()
    assert m.key_count() == 0 and list(m.holds()) == []


def test_long_keys_walk_and_credit_from_a_list() -> None:
    m, ref = both()
    chain = [b"", bytes(range(256)), b"abc", k8(7)]
    for s in (m, ref):
        s.upsert_many(chain, [1, 2, 3, 4], 5, 100, 1)
    assert runs_of(m.walk(chain, [10, 20, 30, 40], 0)) == runs_of(
        ref.walk(chain, [10, 20, 30, 40], 0)
    )
    assert m.walk(chain, [10, 20, 30, 40], 0) == [Run(5, 100, 100, 1, 4)]
    m.credit(chain, 4, 5)
    ref.credit(chain, 4, 5)
    same(m, ref)
    assert all(h.access == 1 for h in m.holds())


def test_key_bytes_references_are_released() -> None:
    m = new()
    key = bytes(range(40)) + b"unique-ref-test"
    before = sys.getrefcount(key)
    m.upsert(key, 1, 1, 1, 1)
    assert sys.getrefcount(key) == before + 1  # the side table keeps the caller's object
    m.upsert(key, 2, 1, 1, 1)
    assert sys.getrefcount(key) == before + 1
    m.remove_hold(key, 1)
    m.remove_hold(key, 2)
    assert sys.getrefcount(key) == before
    m.upsert(key, 1, 1, 1, 1)
    m.remove_key(key)
    assert sys.getrefcount(key) == before
    m.upsert(key, 1, 1, 1, 1)
    m.sweep(5)
    assert sys.getrefcount(key) == before
    m.upsert(key, 1, 1, 1, 1)
    m.remove_replica(1)
    assert sys.getrefcount(key) == before
    m.upsert(key, 1, 1, 1, 1)
    del m
    gc.collect()
    assert sys.getrefcount(key) == before


def test_bytes_subclass_keys_are_copied_to_exact_bytes() -> None:
    class B(bytes):
        pass

    m = new()
    m.upsert(B(b"xyz"), 1, 1, 1, 1)
    m.upsert(B(b"12345678"), 1, 1, 1, 1)
    keys = sorted(h.key for h in m.holds())
    assert keys == [b"12345678", b"xyz"] and all(type(k) is bytes for k in keys)


def test_non_bytes_keys_are_rejected_without_changes() -> None:
    m = new()
    with pytest.raises(TypeError):
        m.upsert("abcdefgh", 1, 1, 1, 1)
    with pytest.raises(TypeError):
        m.upsert_many([k8(1), "x"], [1, 2], 1, 1, 1)
    assert m.hold_count() == 0  # upsert_many validates everything first
    with pytest.raises(TypeError):
        m.upsert_many([k8(1), k8(2)], [1, 2.0], 1, 1, 1)
    assert m.hold_count() == 0
    m.upsert(k8(1), 1, 1, 1, 1)
    with pytest.raises(TypeError):
        m.walk([k8(1), 5], [1, 1], 0)
    with pytest.raises(TypeError):
        m.walk([k8(1)], [1.5], 0)
    with pytest.raises(TypeError):
        m.walk(12, [1], 0)


# ---------------------------------------------------------------------------------------------
# Integers


def test_int32_wrap_of_run_tokens() -> None:
    m, ref = both()
    chain = [k8(i) for i in range(4)]
    for s in (m, ref):
        s.upsert_many(chain, [1, 2, 3, 4], 1, 10, 1)
    for counts in ([I32_MAX, 1, 0, 0], [I32_MIN, -1, 5, 5], [2**40 + 3, 2**33, -(2**35), 7]):
        assert runs_of(m.walk(chain, counts, 0)) == runs_of(ref.walk(chain, counts, 0))
    assert m.walk(chain, [I32_MAX, 1, 0, 0], 0)[0].tokens == I32_MIN
    assert m.walk(chain, [I32_MIN, -1, 0, 0], 0)[0].tokens == I32_MAX


def test_field_ranges() -> None:
    m = new()
    m.upsert(k8(1), 2**32 - 2, I32_MIN, -(2**63), I32_MAX)
    m.upsert(k8(2), 0, I32_MAX, 2**63 - 1, I32_MIN)
    assert sorted(m.holds()) == [
        Hold(k8(1), 2**32 - 2, I32_MIN, -(2**63), I32_MAX, 0),
        Hold(k8(2), 0, I32_MAX, 2**63 - 1, I32_MIN, 0),
    ]
    for args in (
        (k8(3), -1, 0, 0, 1),
        (k8(3), 2**32 - 1, 0, 0, 1),
        (k8(3), 0, I32_MAX + 1, 0, 1),
        (k8(3), 0, 0, 2**63, 1),
        (k8(3), 0, 0, 0, I32_MAX + 1),
    ):
        with pytest.raises(OverflowError):
            m.upsert(*args)
    assert m.hold_count() == 2
    # replicas that cannot be stored hold nothing: removing or crediting them is a no-op
    assert m.remove_hold(k8(1), -1) == 0
    assert m.remove_hold(k8(1), 2**40) == 0
    assert m.remove_replica(-5) == (0, 0)
    m.credit([k8(1)], 1, 2**40)


def test_tiers_up_to_the_sentinel_and_coldest_of_a_run() -> None:
    m, ref = both()
    chain = [k8(i) for i in range(4)]
    tiers = [1, 3, I32_MAX, 2]
    for s in (m, ref):
        for key, tier in zip(chain, tiers, strict=True):
            s.upsert(key, 9, 1, 50, tier)
    assert m.walk(chain, [1] * 4, 0) == [Run(9, 4, 50, I32_MAX, 4)]
    assert m.walk(chain[:2], [1] * 2, 0) == [Run(9, 2, 50, 3, 2)]
    assert runs_of(m.walk(chain, [1] * 4, 0)) == runs_of(ref.walk(chain, [1] * 4, 0))


def test_access_counts_grow_and_survive_refresh() -> None:
    m = new()
    chain = [k8(i) for i in range(3)]
    m.upsert_many(chain, [1, 2, 3], 1, 10, 1)
    m.upsert_many(chain, [1, 2, 3], 2, 10, 1)
    for _ in range(5):
        m.credit(chain, 2, 1)
    m.credit(b"".join(chain), 3, 2)  # packed keys
    m.credit(chain, 99, 2)  # blocks past the end: clamped
    m.credit(chain, -1, 2)
    m.upsert(chain[0], 1, 7, 20, 2)  # refresh keeps access
    got = {(h.key, h.replica): h.access for h in m.holds()}
    assert got == {
        (chain[0], 1): 5,
        (chain[1], 1): 5,
        (chain[2], 1): 0,
        (chain[0], 2): 2,
        (chain[1], 2): 2,
        (chain[2], 2): 2,
    }
    m.remove_hold(chain[0], 1)
    m.upsert(chain[0], 1, 7, 20, 2)  # a new hold starts at 0
    assert {(h.key, h.replica): h.access for h in m.holds()}[(chain[0], 1)] == 0


# ---------------------------------------------------------------------------------------------
# walk


def test_spec_worked_example_runs() -> None:
    """contract-and-index.md §5.5 worked example: A holds h1-h3, B h1-h2, C h1."""
    m, ref = both()
    h = [k8(0xA000 + i) for i in range(4)]
    minute = 60_000_000
    now = 100 * minute
    for s in (m, ref):
        s.upsert_many(h[:3], [64, 128, 192], 0, now - 1 * minute, 1)
        s.upsert_many(h[:2], [64, 128], 1, now - 2 * minute, 1)
        s.upsert_many(h[:1], [64], 2, now - 4 * minute, 1)
    fresh_after = now - 30 * minute
    got = runs_of(m.walk(h, [64, 64, 64, 64], fresh_after))
    assert got == [
        Run(0, 192, now - minute, 1, 3),
        Run(1, 128, now - 2 * minute, 1, 2),
        Run(2, 64, now - 4 * minute, 1, 1),
    ]
    assert got == runs_of(ref.walk(h, [64, 64, 64, 64], fresh_after))
    assert runs_of(m.walk(b"".join(h), [64] * 4, fresh_after)) == got


def test_only_block_zero_seeds_and_a_broken_run_never_resumes() -> None:
    m = new()
    h = [k8(i) for i in range(5)]
    m.upsert_many([h[0], h[2], h[3]], [1, 1, 1], 1, 10, 1)  # misses h1
    m.upsert_many(h[1:], [1, 1, 1, 1], 2, 10, 1)  # deeper only: never seeds
    assert m.walk(h, [5] * 5, 0) == [Run(1, 5, 10, 1, 1)]
    assert m.walk(h[1:], [5] * 4, 0) == [Run(2, 20, 10, 1, 4)]
    assert m.walk([k8(99), *h], [5] * 6, 0) == []  # first-block miss


def test_stale_holds_neither_seed_nor_continue() -> None:
    m, ref = both()
    h = [k8(i) for i in range(4)]
    for s in (m, ref):
        s.upsert_many(h, [1] * 4, 1, 100, 1)
        s.upsert(h[2], 1, 1, 50, 1)  # stale in the middle
        s.upsert_many(h, [1] * 4, 2, 40, 1)  # all stale
    assert m.walk(h, [3] * 4, 50) == [Run(1, 6, 100, 1, 2)]
    assert m.walk(h, [3] * 4, 49) == [Run(1, 12, 50, 1, 4)]
    assert m.walk(h, [3] * 4, 100) == []
    for fa in (0, 39, 40, 49, 50, 100):
        assert runs_of(m.walk(h, [3] * 4, fa)) == runs_of(ref.walk(h, [3] * 4, fa))


def test_walk_input_forms_agree() -> None:
    m = new()
    h = [k8(i * 7919) for i in range(600)]
    m.upsert_many(h, list(range(600)), 1, 10, 1)
    m.upsert_many(h[:300], list(range(300)), 2, 11, 2)
    counts = [16] * 600
    expect = [Run(1, 16 * 600, 10, 1, 600), Run(2, 16 * 300, 11, 2, 300)]
    packed = b"".join(h)

    class Seq(Sequence[bytes]):
        def __init__(self, items: list[bytes]) -> None:
            self.items = items

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: Any) -> Any:
            return self.items[i]

    for keys in (h, tuple(h), packed, bytearray(packed), memoryview(packed), Seq(h)):
        assert runs_of(m.walk(keys, counts, 0)) == expect
        assert runs_of(m.walk(keys, tuple(counts), 0)) == expect
    # the shorter of keys and counts bounds the walk (as in the twin); partial keys are ignored
    assert runs_of(m.walk(h, counts[:10], 0)) == [Run(1, 160, 10, 1, 10), Run(2, 160, 11, 2, 10)]
    assert runs_of(m.walk(packed[:83], counts, 0)) == [
        Run(1, 160, 10, 1, 10),
        Run(2, 160, 11, 2, 10),
    ]
    assert m.walk([], [], 0) == [] and m.walk(b"", [1], 0) == []


def test_many_holders_per_key() -> None:
    """100 replicas on every key: runs tracked through a hash, chains in the overflow arena."""
    m, ref = both()
    h = [k8(1000 + i) for i in range(20)]
    for r in range(100):
        depth = 1 + (r * 7) % 20
        for s in (m, ref):
            s.upsert_many(h[:depth], [1] * depth, r, 1000 + r, 1 + r % 3)
    for s in (m, ref):
        s.upsert(h[5], 42, 1, 10, 1)  # replica 42 stale at block 5
    same(m, ref)
    m.check_invariants()
    for fa in (0, 500, 1020, 1099):
        assert runs_of(m.walk(h, list(range(1, 21)), fa)) == runs_of(
            ref.walk(h, list(range(1, 21)), fa)
        )
    assert len(m.holders(h[0], 0)) == 100
    assert sorted(m.holders(h[0], 1050)) == sorted(ref.holders(h[0], 1050))
    # remove replicas out of the middle of chains, then inline holders
    for r in list(range(0, 100, 3)) + list(range(1, 100, 3)):
        assert m.remove_replica(r) == ref.remove_replica(r)
        m.check_invariants()
    same(m, ref)
    for key in h:
        for r in range(100):
            assert m.remove_hold(key, r) == ref.remove_hold(key, r)
    same(m, ref)
    assert m.hold_count() == 0 and m.key_count() == 0
    m.check_invariants()


# ---------------------------------------------------------------------------------------------
# Growth, shrink, removal scans


def test_growth_and_shrink_return_memory() -> None:
    m = new()
    base_cap, base_mem = m.capacity(), m.memory_bytes()
    keys = [k8(i) for i in range(200_000)]  # sequential keys: the mixer must spread them
    assert m.upsert_many(keys, [1] * len(keys), 1, 10, 1) == (200_000, 200_000)
    m.upsert_many(keys[::2], [1] * 100_000, 2, 20, 1)
    m.upsert_many([bytes(range(i % 50)) + b"L" for i in range(1000)], [1] * 1000, 3, 30, 1)
    assert m.capacity() >= 262_144 and m.key_count() * 4 <= m.capacity() * 3
    m.check_invariants()
    full = m.memory_bytes()
    assert full > 40 * 200_000
    per = m.sweep(15)
    assert per == ({1: 200_000, 3: 0}, 100_000) or per[0] == {1: 200_000}
    assert per[1] == 100_000
    m.check_invariants()
    assert m.key_count() == 100_000 + 50  # 1000 long keys with only 50 distinct values
    m.sweep(25)
    m.check_invariants()
    assert m.key_count() == 50
    assert m.capacity() <= 512 and m.memory_bytes() < full // 100
    m.sweep(35)
    assert m.capacity() == base_cap and m.memory_bytes() == base_mem
    m.check_invariants()


def test_sweep_boundary_and_per_replica_counts() -> None:
    m, ref = both()
    for i in range(50):
        for s in (m, ref):
            s.upsert(k8(i), i % 4, i, 100 + i % 10, 1)
            s.upsert(k8(i), 9, i, 100 + i % 7, 1)
    for t in (99, 100, 103, 106, 109):
        assert m.sweep(t) == ref.sweep(t)
        same(m, ref)
        m.check_invariants()


def test_remove_operations_match_the_twin() -> None:
    m, ref = both()
    for i in range(300):
        for s in (m, ref):
            s.upsert(k8(i % 97), i % 5, i, i, 1)
            s.upsert(ODD_KEYS[i % len(ODD_KEYS)], i % 3, i, i, 2)
    same(m, ref)
    for i in range(0, 97, 5):
        assert sorted(m.remove_key(k8(i))) == sorted(ref.remove_key(k8(i)))
    assert m.remove_key(k8(0)) == [] and m.remove_key(b"nope") == []
    for i in range(1, 97, 4):
        for r in range(5):
            assert m.remove_hold(k8(i), r) == ref.remove_hold(k8(i), r)
    assert m.remove_replica(2) == ref.remove_replica(2)
    same(m, ref)
    m.check_invariants()


def test_candidates_with_ties_and_k_past_the_table() -> None:
    m, ref = both()
    for i in range(40):
        for s in (m, ref):
            s.upsert(k8(i), i % 3, 1, 100 + i // 10, 1)  # four groups of ten tied last_seen
            s.upsert(k8(1000 + i), 7, 1, 100, 1)
    for s in (m, ref):
        s.credit([k8(i) for i in range(10)], 10, 0)
    for k in (0, -3, 1, 5, 45, 50, 51, 79, 80, 81, 10**6, 2**70):
        for lfu in (False, True):
            got = sorted(m.cap_candidates(k, lfu))
            assert got == sorted(ref.cap_candidates(k, lfu))
        assert sorted(m.quota_candidates(k)) == sorted(ref.quota_candidates(k))
    tied = m.cap_candidates(1, False)
    assert len(tied) == 50 and {c[1] for c in tied} == {100}  # k=1 plus every tie
    assert len(m.cap_candidates(10**9, True)) == 80
    assert sorted(m.quota_candidates(2)) == sorted(
        (100, k) for k in [*map(k8, range(10))] + [k8(1000 + i) for i in range(40)]
    )


def test_holds_iterator_detects_changes() -> None:
    m = new()
    for i in range(100):
        m.upsert(k8(i), 1, 1, 1, 1)
    it = iter(m.holds())
    next(it)
    m.upsert(k8(1), 1, 2, 2, 1)  # a refresh is not a structural change
    next(it)
    m.upsert(k8(1000), 1, 1, 1, 1)
    with pytest.raises(RuntimeError):
        next(it)
    it2: Iterator[Hold] = m.holds()
    assert len(list(it2)) == 101 and list(it2) == []


# ---------------------------------------------------------------------------------------------
# No leaks


def _churn(m: Any, rounds: int) -> None:
    for r in range(rounds):
        keys = [k8(r * 10_000 + i) for i in range(2000)] + [
            bytes([r % 7]) * (i % 30) for i in range(50)
        ]
        m.upsert_many(keys, [1] * len(keys), r % 4, r, 1)
        m.upsert_many(keys[:500], [1] * 500, (r + 1) % 4, r, 1)
        m.walk(keys[:512], [1] * 512, -1)
        m.credit(keys, 100, r % 4)
        m.cap_candidates(100, True)
        m.quota_candidates(100)
        list(m.holds())
        m.replica_summary()
        m.sweep(r - 2)
        if r % 5 == 0:
            m.remove_replica((r + 2) % 4)


def test_no_leak_under_churn() -> None:
    m = new()
    _churn(m, 10)  # warm up: table at its steady size
    gc.collect()
    tracemalloc.start()
    try:
        _churn(m, 5)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        _churn(m, 40)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    m.check_invariants()
    # steady state: the table, arena and side table stay at their size; nothing accumulates
    assert after - before < 256 * 1024, (before, after)
    m.sweep(10**9)
    assert m.hold_count() == 0 and m.capacity() == 8


def test_overflow_arena_and_side_table_compact_after_removals() -> None:
    m, ref = both()
    keys = [k8(i) for i in range(5000)]
    longs = [b"long-key-%d" % i for i in range(400)]
    for r in range(5):
        for s in (m, ref):
            s.upsert_many(keys, list(range(5000)), r, 100 + r, 1)
            s.upsert_many(longs, [1] * 400, r, 100 + r, 1)
    m.check_invariants()
    full = m.memory_bytes()
    # replicas 1..4 live in the overflow arena (replica 0 stored first, inline)
    for r in (3, 1, 4):
        assert m.remove_replica(r) == ref.remove_replica(r)
        m.check_invariants()
    same(m, ref)
    assert m.memory_bytes() < full - 5000 * 32  # the arena gave memory back
    mid = m.memory_bytes()
    # inline holders go: the remaining overflow holder is promoted into the slot
    assert m.remove_replica(0) == ref.remove_replica(0)
    m.check_invariants()
    same(m, ref)
    assert m.memory_bytes() < mid
    for key in longs[:390]:
        assert m.remove_key(key) == ref.remove_key(key)
    m.check_invariants()
    same(m, ref)
    assert sorted(m.walk(keys[:300], [1] * 300, 0)) == sorted(ref.walk(keys[:300], [1] * 300, 0))


def test_reentrant_calls_are_refused_not_corrupting() -> None:
    """A call made while another is running (here from a gc callback triggered by the result
    allocations of cap_candidates) raises RuntimeError instead of moving slots under it."""
    m = new()
    for i in range(3000):
        m.upsert(k8(i), i % 3, 1, i, 1)
    seen: list[BaseException] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and len(seen) < 5:
            try:
                m.upsert(k8(10**9 + len(seen)), 1, 1, 1, 1)
            except RuntimeError as e:
                seen.append(e)

    old = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(5)
    try:
        got = m.cap_candidates(2500, False)
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(callback)
    assert len(got) == 2500
    assert seen and all("re-entrantly" in str(e) for e in seen)
    assert m.hold_count() == 3000
    m.check_invariants()
    m.upsert(k8(10**9), 1, 1, 1, 1)  # usable again afterwards
    assert m.hold_count() == 3001


def test_upsert_many_accepts_packed_keys() -> None:
    """An extension over the Protocol (which passes a list): packed 8-byte keys, any buffer."""
    from array import array

    m, ref = both()
    keys = [k8(i * 31) for i in range(100)]
    assert m.upsert_many(b"".join(keys), list(range(100)), 4, 50, 2) == (100, 100)
    ref.upsert_many(keys, list(range(100)), 4, 50, 2)
    same(m, ref)
    as_array = array("Q", [int.from_bytes(k, sys.byteorder) for k in keys])
    assert m.upsert_many(as_array, [7] * 100, 5, 60, 1) == (0, 100)
    assert sorted(m.walk(memoryview(as_array), [1] * 100, 0)) == [
        Run(4, 100, 50, 2, 100),
        Run(5, 100, 60, 1, 100),
    ]


def test_candidate_cache_follows_value_changes() -> None:
    """cap_candidates keeps candidates between calls; holds whose value moved (refresh to
    another time, LFU credit, new holds with old timestamps) must still come out in order."""
    m, ref = both()
    m._tune_candidates(6, 1)  # keep max(k, 6) candidates
    h = [k8(0xC0 + i) for i in range(20)]
    for i, key in enumerate(h):
        for s in (m, ref):
            s.upsert(key, 1, 1, i + 1, 1)  # last_seen 1..20
    assert sorted(m.cap_candidates(4, False)) == sorted(ref.cap_candidates(4, False))
    for s in (m, ref):
        s.upsert(h[0], 1, 1, 5, 1)  # refresh: 1 -> 5, still inside the kept six
        s.remove_hold(h[1], 1)
        s.remove_hold(h[2], 1)
    got = sorted(m.cap_candidates(2, False))
    assert got == sorted(ref.cap_candidates(2, False))
    assert [c[1] for c in got] == [4, 5, 5]  # h3, then h0 and h4 tied at 5
    for s in (m, ref):
        s.upsert(k8(0xFF), 2, 1, 0, 1)  # a new hold older than everything
    assert sorted(m.cap_candidates(1, False)) == sorted(ref.cap_candidates(1, False))
    # LFU: credits raise counts of kept candidates
    assert sorted(m.cap_candidates(3, True)) == sorted(ref.cap_candidates(3, True))
    for s in (m, ref):
        s.credit([k8(0xFF), h[3]], 2, 1)
        s.credit([k8(0xFF)], 1, 2)
    for k in (1, 2, 3, 5):
        assert sorted(m.cap_candidates(k, True)) == sorted(ref.cap_candidates(k, True))
        assert sorted(m.cap_candidates(k, False)) == sorted(ref.cap_candidates(k, False))
    assert m.memory_bytes() > 0


def test_candidate_cache_follows_lfu_credits_below_its_threshold() -> None:
    m, ref = both()
    m._tune_candidates(6, 1)
    h = [k8(0xD0 + i) for i in range(10)]
    for i, key in enumerate(h):
        for s in (m, ref):
            s.upsert(key, 1, 1, i + 1, 1)
    for s in (m, ref):
        for _ in range(5):
            s.credit(h[3:], 7, 1)  # h3..h9 at access 5, h0..h2 at 0
    first = sorted(m.cap_candidates(2, True))
    assert first == sorted(ref.cap_candidates(2, True))
    assert [c[3] for c in first] == [1, 1]
    for s in (m, ref):
        s.credit([h[0]], 1, 1)  # a kept candidate moves to access 1: still below the kept edge
    got = sorted(m.cap_candidates(3, True))
    assert got == sorted(ref.cap_candidates(3, True))
    assert got == [(0, 2, h[1], 1), (0, 3, h[2], 1), (1, 1, h[0], 1)]


def test_candidate_cache_releases_key_references() -> None:
    m = new()
    m._tune_candidates(2, 1)
    key = bytes(range(50)) + b"cached-candidate"
    before = sys.getrefcount(key)
    m.upsert(key, 1, 1, 1, 1)
    for i in range(10):
        m.upsert(k8(i), 1, 1, 100 + i, 1)
    assert m.cap_candidates(1, False) == [(0, 1, key, 1)]
    assert sys.getrefcount(key) >= before + 2  # the side table and the kept candidate
    m.remove_hold(key, 1)
    assert m.cap_candidates(1, False) == [(0, 100, k8(0), 1)]  # the stale candidate is dropped
    assert sys.getrefcount(key) == before
    m.upsert(key, 1, 1, 1, 1)
    m.cap_candidates(2, True)
    del m
    gc.collect()
    assert sys.getrefcount(key) == before


def test_quota_candidate_cache_follows_removals_and_old_timestamps() -> None:
    m, ref = both()
    m._tune_candidates(2, 1)  # keep max(k, 2) keys between calls
    h = [k8(0xE0 + i) for i in range(10)]
    for s in (m, ref):
        s.upsert(h[8], 3, 1, 2, 1)  # h8: an old inline hold, then a new overflow hold
        for i, key in enumerate(h):
            s.upsert(key, 1, 1, 10 + i, 1)
        s.upsert(h[9], 2, 1, 1, 1)  # h9: new inline hold, old overflow hold
    assert sorted(m.quota_candidates(2)) == sorted(ref.quota_candidates(2))  # h0, h1 kept
    for s in (m, ref):
        s.remove_hold(h[9], 1)  # inline removed: h9's newest drops to 1
    assert sorted(m.quota_candidates(1)) == sorted(ref.quota_candidates(1)) == [(1, h[9])]
    for s in (m, ref):
        s.remove_hold(h[8], 1)  # overflow removed: h8's newest drops to 2
        s.upsert(k8(0xEE), 4, 1, 0, 1)  # a new key older than everything
        s.upsert(h[5], 1, 1, 3, 1)  # a refresh to an earlier time
    for k in (1, 2, 3, 4):
        assert sorted(m.quota_candidates(k)) == sorted(ref.quota_candidates(k))
    assert [c[0] for c in sorted(m.quota_candidates(4))] == [0, 1, 2, 3]
