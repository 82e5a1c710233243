"""The ``PartitionStore`` contract (``index/store.py``), for every backend, against a naive
reference written straight from the Protocol's docstrings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache.index import STORE_BACKENDS
from inferencecache.index.memstore import MemStore
from inferencecache.index.store import (
    HOLD_REMOVED,
    KEY_REMOVED,
    NEW_HOLD,
    NEW_KEY,
    OPTIONAL,
    Hold,
    PartitionOps,
    PartitionStore,
    Run,
)

StoreFactory = Callable[[], PartitionStore]


class RequiredOnly:
    """A backend with exactly the required operations (a MemStore behind them), so every
    capability runs its ``store.py`` default."""

    def __init__(self) -> None:
        inner = MemStore()
        for name in ("key_count", "hold_count", "upsert", "holders", "walk", "credit",
                     "remove_hold", "holds"):  # fmt: skip
            setattr(self, name, getattr(inner, name))


@pytest.fixture(params=[*sorted(STORE_BACKENDS), "required_only"])
def store_factory(request: pytest.FixtureRequest) -> StoreFactory:
    """Every backend of the build, and the required operations alone."""
    if request.param == "required_only":
        return RequiredOnly  # type: ignore[return-value]
    factory: StoreFactory = STORE_BACKENDS[request.param]
    return factory


def test_required_only_has_no_capability() -> None:
    ops = PartitionOps(RequiredOnly())  # type: ignore[arg-type]
    for name in OPTIONAL:
        assert getattr(ops, name).func.__module__ == "inferencecache.index.store", name


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def wrap32(x: int) -> int:
    return ((x + 2**31) % 2**32) - 2**31


class Reference:
    """The Protocol, as plainly as possible (quadratic where that is simplest)."""

    def __init__(self) -> None:
        self.h: dict[tuple[bytes, int], list[int]] = {}  # (key, replica) -> tokens, ts, tier, acc

    def upsert(self, key: bytes, replica: int, tokens: int, last_seen: int, tier: int) -> int:
        bits = 0
        if not any(kk == key for kk, _ in self.h):
            bits |= NEW_KEY
        cur = self.h.get((key, replica))
        if cur is None:
            bits |= NEW_HOLD
            self.h[(key, replica)] = [tokens, last_seen, tier, 0]
        else:
            cur[:3] = [tokens, last_seen, tier]
        return bits

    def walk(self, keys: Sequence[bytes], counts: Sequence[int], fresh_after: int) -> list[Run]:
        if not keys:
            return []
        runs = {
            r: [counts[0], v[1], v[2], 1]
            for (kk, r), v in self.h.items()
            if kk == keys[0] and v[1] > fresh_after
        }
        final: list[Run] = []
        for i in range(1, len(keys)):
            if not runs:
                break
            cont = {}
            for r, run in runs.items():
                v = self.h.get((keys[i], r))
                if v is not None and v[1] > fresh_after:
                    cont[r] = [run[0] + counts[i], min(run[1], v[1]), max(run[2], v[2]), run[3] + 1]
                else:
                    final.append(Run(r, wrap32(run[0]), run[1], run[2], run[3]))
            runs = cont
        final += [Run(r, wrap32(a), b, c, d) for r, (a, b, c, d) in runs.items()]
        return sorted(final)

    def holds(self) -> list[Hold]:
        return sorted(Hold(kk, r, *v) for (kk, r), v in self.h.items())


def test_upsert_bits_and_counts(store_factory: StoreFactory) -> None:
    s = PartitionOps(store_factory())
    assert s.upsert(k(1), 0, 16, 100, 1) == NEW_KEY | NEW_HOLD
    assert s.upsert(k(1), 1, 16, 100, 1) == NEW_HOLD
    assert s.upsert(k(1), 1, 32, 200, 2) == 0
    assert (s.key_count(), s.hold_count()) == (1, 2)
    assert s.upsert_many([k(1), k(2), k(2), k(3)], [1, 2, 3, 4], 1, 300, 3) == (2, 2)
    assert (s.key_count(), s.hold_count()) == (3, 4)
    assert sorted(s.holders(k(2), 0)) == [(1, 3, 300, 3)]  # last write wins inside a batch


def test_packed_keys_everywhere(store_factory: StoreFactory) -> None:
    s = PartitionOps(store_factory())
    s.upsert_many([k(1), k(2), k(3)], [16, 32, 48], 7, 100, 1)
    packed = k(1) + k(2) + k(3)
    assert s.walk(packed, [10, 10, 10], 0) == s.walk([k(1), k(2), k(3)], [10, 10, 10], 0)
    assert s.walk(packed, [10, 10, 10], 0) == [Run(7, 30, 100, 1, 3)]
    s.credit(packed, 2, 7)
    assert sorted(h.access for h in s.holds()) == [0, 1, 1]
    assert s.walk(b"", [], 0) == [] and s.walk([], [], 0) == []
    # upsert_many and remove_holds take packed keys too; a trailing partial key is ignored
    assert s.upsert_many(k(3) + k(4) + b"xyz", [1, 2, 3], 8, 200, 2) == (1, 2)
    assert sorted(s.holders(k(4), 0)) == [(8, 2, 200, 2)]
    assert s.remove_holds(k(4) + k(9) + k(3) + b"x", 8) == (2, 1)
    assert s.remove_holds([k(1), k(1), k(2)], 7) == (2, 2)
    assert s.remove_holds(b"", 7) == (0, 0) and s.remove_holds([k(3)], 2**40) == (0, 0)
    assert sorted((h.key, h.replica) for h in s.holds()) == [(k(3), 7)]


def test_remove_holds_rejects_a_bad_key_before_touching_anything(
    store_factory: StoreFactory,
) -> None:
    import pytest

    s = PartitionOps(store_factory())
    s.upsert_many([k(1), k(2)], [1, 1], 1, 100, 1)
    with pytest.raises(TypeError):
        s.remove_holds([k(1), "x"], 1)  # type: ignore[list-item]
    assert s.hold_count() == 2


def test_walk_semantics(store_factory: StoreFactory) -> None:
    s = PartitionOps(store_factory())
    s.upsert_many([k(1), k(2), k(3), k(4)], [0, 0, 0, 0], 1, 100, 1)
    s.upsert_many([k(1), k(2)], [0, 0], 2, 50, 2)
    s.upsert_many([k(1), k(3), k(4)], [0, 0, 0], 3, 100, 1)  # gap at block 1: never re-enters
    s.upsert(k(2), 4, 0, 100, 1)  # deeper block only: never seeds
    s.upsert(k(3), 2, 0, 10, 1)  # stale at fresh_after=20: ends replica 2's run
    runs = sorted(s.walk([k(1), k(2), k(3), k(4), k(5)], [1, 2, 4, 8, 16], 20))
    assert runs == [Run(1, 15, 100, 1, 4), Run(2, 3, 50, 2, 2), Run(3, 1, 100, 1, 1)]
    assert s.walk([k(9), k(1)], [1, 1], 0) == []
    assert s.walk([k(1)], [1], 100) == []  # fresh means last_seen > fresh_after


def test_removals(store_factory: StoreFactory) -> None:
    s = PartitionOps(store_factory())
    s.upsert_many([k(1), k(2), k(3)], [1, 1, 1], 1, 100, 1)
    s.upsert_many([k(1), k(2)], [1, 1], 2, 200, 1)
    assert s.remove_hold(k(1), 1) == HOLD_REMOVED
    assert s.remove_hold(k(1), 1) == 0
    assert s.remove_hold(k(3), 1) == HOLD_REMOVED | KEY_REMOVED
    assert s.remove_hold(k(9), 1) == 0
    assert s.remove_replica(2) == (2, 1)  # k(1) went with it
    assert s.remove_replica(2) == (0, 0)
    assert sorted(s.remove_key(k(2))) == [1]
    assert s.remove_key(k(2)) == []
    assert (s.key_count(), s.hold_count(), list(s.holds())) == (0, 0, [])


def test_sweep_and_summaries(store_factory: StoreFactory) -> None:
    s = PartitionOps(store_factory())
    s.upsert_many([k(1), k(2), k(3)], [1, 1, 1], 1, 100, 1)
    s.upsert_many([k(1), k(4)], [1, 1], 2, 150, 1)
    assert s.replica_summary() == {1: (3, 100), 2: (2, 150)}
    assert s.sweep(99) == ({}, 0)
    per, gone = s.sweep(100)  # at-or-before
    assert (per, gone) == ({1: 3}, 2)
    assert s.replica_summary() == {2: (2, 150)}


def test_candidates_include_ties(store_factory: StoreFactory) -> None:
    s = PartitionOps(store_factory())
    s.upsert_many([k(1), k(2), k(3), k(4)], [1] * 4, 1, 100, 1)
    s.upsert(k(5), 1, 1, 50, 1)
    s.upsert(k(6), 1, 1, 300, 1)
    s.upsert(k(1), 2, 1, 300, 1)
    s.credit([k(5)], 1, 1)
    lru = sorted(s.cap_candidates(2, False))
    assert lru == [(0, 50, k(5), 1)] + [(0, 100, k(i), 1) for i in range(1, 5)]
    lfu = sorted(s.cap_candidates(1, True))
    assert lfu == [(0, 100, k(i), 1) for i in range(1, 5)]
    assert len(s.cap_candidates(100, False)) == 7 and s.cap_candidates(0, False) == []
    q = sorted(s.quota_candidates(1))
    assert q == [(50, k(5))]
    q = sorted(s.quota_candidates(2))
    assert q == [(50, k(5))] + [(100, k(i)) for i in (2, 3, 4)]  # k(1)'s newest is 300


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("up"),
            st.lists(st.integers(0, 6), min_size=1, max_size=6),
            st.integers(0, 3),
            st.integers(0, 9),
            st.sampled_from([1, 2, 3, 2**31 - 1]),
            st.integers(-(2**31), 2**31 - 1),
        ),
        st.tuples(st.just("rm"), st.integers(0, 6), st.integers(0, 3)),
        st.tuples(st.just("rmr"), st.integers(0, 3)),
        st.tuples(st.just("rms"), st.lists(st.integers(0, 6), max_size=5), st.integers(0, 3),
                  st.booleans()),
        st.tuples(st.just("rmk"), st.integers(0, 6)),
        st.tuples(st.just("cr"), st.lists(st.integers(0, 6), max_size=5), st.integers(0, 3)),
        st.tuples(st.just("sw"), st.integers(-1, 9)),
    ),
    max_size=30,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    ops=OPS,
    probe=st.lists(st.integers(0, 6), max_size=7),
    counts=st.integers(-5, 2**31 - 1),
    fresh_after=st.integers(-1, 9),
)
def test_store_matches_the_reference(
    store_factory: StoreFactory, ops: list[Any], probe: list[int], counts: int, fresh_after: int
) -> None:
    s = PartitionOps(store_factory())
    ref = Reference()
    for op in ops:
        if op[0] == "up":
            _, keys, r, ts, tier, tok = op
            toks = [wrap32(tok + i) for i in range(len(keys))]
            nk, nh = s.upsert_many([k(i) for i in keys], toks, r, ts, tier)
            bits = [ref.upsert(k(i), r, t, ts, tier) for i, t in zip(keys, toks, strict=True)]
            assert (nk, nh) == (
                sum(b & NEW_KEY for b in bits),
                sum(1 for b in bits if b & NEW_HOLD),
            )
        elif op[0] == "rm":
            removed = 0
            if (k(op[1]), op[2]) in ref.h:
                del ref.h[(k(op[1]), op[2])]
                last = not any(kk == k(op[1]) for kk, _ in ref.h)
                removed = HOLD_REMOVED | (KEY_REMOVED if last else 0)
            assert s.remove_hold(k(op[1]), op[2]) == removed
        elif op[0] == "rms":
            holds = keys_gone = 0
            for i in op[1]:
                if (k(i), op[2]) in ref.h:
                    del ref.h[(k(i), op[2])]
                    holds += 1
                    keys_gone += not any(kk == k(i) for kk, _ in ref.h)
            keys_ = [k(i) for i in op[1]]
            arg: list[bytes] | bytes = b"".join(keys_) if op[3] else keys_
            assert s.remove_holds(arg, op[2]) == (holds, keys_gone)
        elif op[0] == "rmr":
            gone = [hk for hk in ref.h if hk[1] == op[1]]
            for hk in gone:
                del ref.h[hk]
            keys_left = {kk for kk, _ in ref.h}
            assert s.remove_replica(op[1]) == (len(gone), len({kk for kk, _ in gone} - keys_left))
        elif op[0] == "rmk":
            mine = sorted(r for kk, r in ref.h if kk == k(op[1]))
            for r in mine:
                del ref.h[(k(op[1]), r)]
            assert sorted(s.remove_key(k(op[1]))) == mine
        elif op[0] == "cr":
            for i in op[1]:
                v = ref.h.get((k(i), op[2]))
                if v is not None:
                    v[3] += 1
            s.credit([k(i) for i in op[1]], len(op[1]), op[2])
        else:
            stale = [hk for hk, v in ref.h.items() if v[1] <= op[1]]
            per: dict[int, int] = {}
            for hk in stale:
                per[hk[1]] = per.get(hk[1], 0) + 1
                del ref.h[hk]
            before = {kk for kk, _ in stale}
            after = {kk for kk, _ in ref.h}
            assert s.sweep(op[1]) == (per, len(before - after))
        assert sorted(s.holds()) == ref.holds()
        assert s.hold_count() == len(ref.h) and s.key_count() == len({kk for kk, _ in ref.h})
    keys = [k(i) for i in probe]
    cs = [counts - i for i in range(len(keys))]
    assert sorted(s.walk(keys, cs, fresh_after)) == ref.walk(keys, cs, fresh_after)
    for key in map(k, range(7)):
        want_h = sorted(
            (r, v[0], v[1], v[2])
            for (kk, r), v in ref.h.items()
            if kk == key and v[1] > fresh_after
        )
        assert sorted(s.holders(key, fresh_after)) == want_h
    for n in (1, 2, 5):
        for lfu in (False, True):
            allh = sorted(((v[3] if lfu else 0), v[1], kk, r) for (kk, r), v in ref.h.items())
            want = allh if len(allh) <= n else [c for c in allh if c[:2] <= allh[n - 1][:2]]
            assert sorted(s.cap_candidates(n, lfu)) == want
        newest: dict[bytes, int] = {}
        for (kk, _), v in ref.h.items():
            newest[kk] = max(newest.get(kk, v[1]), v[1])
        allk = sorted((ts, kk) for kk, ts in newest.items())
        want_q = allk if len(allk) <= n else [c for c in allk if c[0] <= allk[n - 1][0]]
        assert sorted(s.quota_candidates(n)) == want_q
    summary: dict[int, tuple[int, int]] = {}
    for (_, r), v in ref.h.items():
        c, ts = summary.get(r, (0, v[1]))
        summary[r] = (c + 1, max(ts, v[1]))
    assert s.replica_summary() == summary
