"""Differential tests of the compiled scoring step (``_rank.Ranker``, ``BlockMap.walk_ranked``,
packed walk counts) against the pure-Python reference (``ranking.PyRanker``).

The compiled ranker may decline an input (None: the caller runs the twin); whenever it answers, the
answer must be the twin's to the bit: same rows, same order, same float32 scores (sign of zero
included), same G1 cut and LFU credit list. The strategies aim at the edges of contract
contract-and-index.md §5.4: ties broken by replica name, token sums <= 0, freshness at 0/1 and on
the TTL, float32 rounding of large counts, stats rows on the freshness boundary, SLO bias, DP with
0/1/n replicas in scope, and floors exactly hit.
"""

from __future__ import annotations

import math
import struct
from array import array
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache.index.apply import f32
from inferencecache.index.memstore import MemStore
from inferencecache.index.model import ReplicaScore
from inferencecache.index.ranking import PyRanker, RankSettings
from inferencecache.index.state import StatsRow
from inferencecache.index.store import PartitionOps, Run

from ._native import BLOCKMAP, RANK

pytestmark = pytest.mark.skipif(RANK is None, reason="C accelerator not built")

NOW = 1_700_000_000_000_000
TTL = 1_800_000_000
I32 = st.integers(-(2**31), 2**31 - 1)
TOKENS = st.one_of(
    st.sampled_from([0, -16, 16, 32, 64, 256, 8192, 2**24 + 1, 2**31 - 1, -(2**31)]),
    st.integers(-100, 5000),
    I32,
)
TIER = st.sampled_from([0, 1, 2, 3, 4, 2**31 - 1, -1])
NAMES = st.lists(
    st.one_of(st.none(), st.sampled_from(["", "r0", "r1", "a", "b", "é", "\U0001f600", "r10"])),
    min_size=1,
    max_size=10,
)
PRESSURE = st.one_of(
    st.sampled_from([0.0, -0.0, 0.1, 0.5, 1.0, 2.0, -1.0]),
    st.floats(-2.0, 2.0, allow_nan=False).map(f32),
)
WEIGHT = st.sampled_from([0.0, 1.0, 0.5, 2.0, 1e-30, 1e30])
SLO = st.sampled_from([0.0, 1.0, f32(0.3), f32(2.5), f32(1e-3)])


def ages(ttl: int) -> st.SearchStrategy[int]:
    """Ages around the freshness edges: <= 0, just inside and on the TTL, anywhere."""
    return st.one_of(
        st.sampled_from([0, -5, 1, ttl - 1, ttl, ttl + 1, ttl // 2, ttl // 3]),
        st.integers(0, ttl),
    )


@st.composite
def cases(draw: st.DrawFn, chain: bool | None = None, ordinary: bool = False) -> dict[str, Any]:
    """Ranker inputs; ``ordinary``: only what the compiled ranker must answer itself (known
    replica ids, times far from int64 limits)."""
    ttl = draw(st.one_of(st.sampled_from([TTL, 1, 3, 1_000_000]), st.integers(1, 2**40)))
    now = NOW if ordinary else draw(st.sampled_from([NOW, 0, 2**62]))
    names = draw(NAMES)
    n_names = len(names)
    rid = st.integers(0, n_names - 1)
    if not ordinary:
        rid = st.one_of(rid, rid, st.just(n_names))
    is_chain = draw(st.booleans()) if chain is None else chain
    rows: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(0, 12))):
        r = draw(rid)
        tokens = draw(TOKENS)
        seen = now - draw(ages(ttl))
        tier = draw(TIER)
        if is_chain:
            rows.append(Run(r, tokens, seen, tier, draw(st.integers(1, 600))))
        else:
            rows.append((r, tokens, seen, tier))
    stats: dict[int, StatsRow] | None = None
    if draw(st.booleans()):
        stats = {}
        for r in draw(st.lists(st.integers(0, n_names), max_size=6)):
            row = StatsRow(0, 0.5, draw(PRESSURE), 0, 0, 0)
            row.stats_reported = now - ttl + draw(st.sampled_from([0, 1, -1, 5, ttl, ttl + 7]))
            stats[r] = row
    matched = [row[1] for row in rows]
    min_matched = draw(st.one_of(st.just(0), st.sampled_from(matched or [0]), st.integers(0, 9000)))
    return {
        "rows": rows,
        "chain": is_chain,
        "names": names,
        "now": now,
        "ttl": ttl,
        "total": draw(st.one_of(st.integers(0, 3), st.integers(0, 20))),
        "stats": stats,
        "weight": draw(WEIGHT),
        "slo": draw(SLO),
        "min_matched": min_matched,
        "credit": draw(st.booleans()),
    }


TIGHT = 200


def settings_of(c: dict[str, Any]) -> RankSettings:
    return RankSettings(ttl_us=c["ttl"], pressure_weight=c["weight"], slo_tight_ttft_ms=TIGHT,
                        slo_bias=c["slo"], min_matched=c["min_matched"], credit=c["credit"])


def bind_args(c: dict[str, Any]) -> tuple[Any, ...]:
    """(now_us, total, stats, ttft_ms): a tight TTFT whenever the case has an SLO bias."""
    return c["now"], c["total"], c["stats"], TIGHT // 2 if c["slo"] else 0


def py_ranker(c: dict[str, Any]) -> Any:
    return PyRanker(c["names"], settings_of(c)).bind(*bind_args(c))


def compiled(c: dict[str, Any]) -> Any:
    assert RANK is not None
    return RANK.Ranker(c["names"], settings_of(c)).bind(*bind_args(c))


def case(names: Any, **kw: Any) -> dict[str, Any]:
    c = {"names": names, "now": NOW, "ttl": TTL, "total": 1, "stats": None, "weight": 1.0,
         "slo": 0.0, "min_matched": 0, "credit": False}  # fmt: skip
    c.update(kw)
    return c


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def same(got: Any, want: Any) -> None:
    """Equal results, floats compared by bit pattern (0.0 vs -0.0, float32 values)."""
    assert got[0] == want[0]
    assert [type(s) for s in got[1]] == [ReplicaScore] * len(got[1])
    key = [
        (s.replica_id, bits(s.score), s.matched_tokens, bits(s.estimated_cache_hit_prob), s.tier)
        for s in got[1]
    ]
    assert key == [
        (s.replica_id, bits(s.score), s.matched_tokens, bits(s.estimated_cache_hit_prob), s.tier)
        for s in want[1]
    ]
    assert got[2] == want[2]


def twin_or_error(rows: Any, c: dict[str, Any]) -> Any:
    try:
        return py_ranker(c).rank(rows, c["chain"])
    except Exception as e:
        return e


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_compiled_ranker_equals_twin(c: dict[str, Any]) -> None:
    want = twin_or_error(c["rows"], c)
    got = compiled(c).rank(list(c["rows"]), c["chain"])
    if got is None:  # declined: the caller runs the twin
        return
    assert not isinstance(want, Exception), want
    same(got, want)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(cases(ordinary=True))
def test_compiled_ranker_answers_ordinary_inputs(c: dict[str, Any]) -> None:
    """Declining is only for what it does not mirror (NaN, huge values, unknown ids)."""
    got = compiled(c).rank(list(c["rows"]), c["chain"])
    assert got is not None
    same(got, py_ranker(c).rank(c["rows"], c["chain"]))


def test_ties_break_by_replica_name_and_keep_input_order() -> None:
    c = case(["b", "a", "c", None, ""], credit=True)
    rows = [Run(i, 64, NOW, 1, 4) for i in range(5)]
    got = compiled(c).rank(rows, True)
    same(got, py_ranker(c).rank(rows, True))
    assert [s.replica_id for s in got[1]] == ["", "", "a", "b", "c"]
    assert got[2] == [(3, 4), (4, 4), (1, 4), (0, 4), (2, 4)]


def test_dp_freshness_pressure_and_g1_worked_example() -> None:
    """contract-and-index.md §5.5's worked example: 192 x 29/30 x 2/3, 128 x 28/30 x 1/3, 64 x 26/30
    x 0."""
    minute = 60_000_000
    rows = [
        Run(0, 192, NOW - minute, 1, 3),
        Run(1, 128, NOW - 2 * minute, 1, 2),
        Run(2, 64, NOW - 4 * minute, 1, 1),
    ]
    c = case(["A", "B", "C"], total=3, min_matched=64)
    got = compiled(c).rank(rows, True)
    same(got, py_ranker(c).rank(rows, True))
    assert [s.replica_id for s in got[1]] == ["A", "B", "C"]
    assert [round(s.score, 2) for s in got[1]] == [123.73, 39.82, 0.0]
    got = compiled(case(["A", "B", "C"], total=3, min_matched=128)).rank(rows, True)
    assert got[0] == 3 and [s.replica_id for s in got[1]] == ["A", "B"]


def test_slo_bias_applies_only_to_tight_requests() -> None:
    rows = [Run(0, 64, NOW - TTL // 2, 1, 1)]
    c = case(["r"], slo=f32(0.3))
    settings_ = settings_of(c)
    scores = []
    for ttft in (0, 1, TIGHT - 1, TIGHT, -5):
        got = RANK.Ranker(["r"], settings_).bind(NOW, 1, None, ttft).rank(rows, True)  # type: ignore[union-attr]
        same(got, PyRanker(["r"], settings_).bind(NOW, 1, None, ttft).rank(rows, True))
        scores.append(got[1][0].score)
    assert scores[1] == scores[2] > scores[0] == scores[3] == scores[4]


def test_float32_rounding_of_large_counts() -> None:
    rows = [Run(0, 2**24 + 1, NOW, 1, 1)]
    c = case(["r"])
    got = compiled(c).rank(rows, True)
    assert got[1][0].score == float(2**24)  # float32 rounds 2**24 + 1 to even
    same(got, py_ranker(c).rank(rows, True))


def test_declines_what_it_does_not_mirror() -> None:
    runs = [Run(0, 64, NOW, 1, 1)]
    base = case(["r"], total=2)
    assert compiled(base).rank(runs, True) is not None
    # an infinite weight times a zero pressure is NaN
    assert compiled(case(["r"], total=2, weight=math.inf)).rank(runs, True) is None
    assert compiled(case(["r"], total=2, ttl=2**60)).rank(runs, True) is None
    assert compiled(base).rank([Run(5, 64, NOW, 1, 1)], True) is None  # unknown replica id
    assert compiled(case(["r"], now=2**70)).rank(runs, True) is None
    assert compiled(base).rank(tuple(runs), True) is None
    assert compiled(case(["r"], weight=1)).rank(runs, True) is None  # an int weight
    assert compiled(case(("r",))).rank(runs, True) is None  # names not a list


def test_ranker_reads_its_settings_by_name() -> None:
    assert RANK is not None

    class Partial:
        ttl_us = TTL

    with pytest.raises(AttributeError):
        RANK.Ranker(["r"], Partial())  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The fused walk and the packed count forms


needs_blockmap = pytest.mark.skipif(BLOCKMAP is None, reason="C store not built")


def k8(i: int) -> bytes:
    return struct.pack(">Q", 0x0101_0101_0000_0000 + i)


@st.composite
def stores(draw: st.DrawFn) -> tuple[Any, MemStore, list[bytes], list[int], int, dict[str, Any]]:
    assert BLOCKMAP is not None
    native, mem = BLOCKMAP.BlockMap(), MemStore()
    n_blocks = draw(st.integers(1, 40))
    keys = [k8(i) for i in range(n_blocks)]
    names = [f"r{i}" for i in range(draw(st.integers(1, 9)))]
    for rid in range(len(names)):
        upto = draw(st.integers(0, n_blocks))
        seen = NOW - draw(st.sampled_from([0, 1, TTL // 2, TTL - 1, TTL]))
        tier = draw(TIER.filter(lambda t: t >= 0))
        for i in range(upto):
            for s in (native, mem):
                s.upsert(keys[i], rid, 16 * (i + 1), seen, tier)
    counts = draw(
        st.one_of(
            st.lists(st.integers(0, 255), min_size=n_blocks, max_size=n_blocks),
            st.just([16] * n_blocks),
            st.lists(I32, min_size=n_blocks, max_size=n_blocks),
        )
    )
    c = draw(cases(chain=True))
    c["names"] = names
    c["now"] = NOW
    c["ttl"] = TTL
    return native, mem, keys, counts, NOW - TTL, c


@needs_blockmap
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(stores())
def test_walk_ranked_equals_walk_then_twin(
    s: tuple[Any, MemStore, list[bytes], list[int], int, dict[str, Any]],
) -> None:
    native, mem, keys, counts, fresh_after, c = s
    want = py_ranker(c).rank(mem.walk(keys, counts, fresh_after), True)
    ops = PartitionOps(mem)  # the default walk_ranked
    same(ops.walk_ranked(keys, counts, fresh_after, py_ranker(c)), want)
    packed = b"".join(keys)
    for ks in (keys, packed):
        got = native.walk_ranked(ks, counts, fresh_after, compiled(c))
        if got is not None:
            same(got, want)
        # a non-compiled ranker is called with the Run list
        same(native.walk_ranked(ks, counts, fresh_after, py_ranker(c)), want)
        got = ops.walk_ranked(ks, counts, fresh_after, compiled(c))
        if got is not None:
            same(got, want)


@needs_blockmap
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(stores())
def test_packed_counts_walk_like_a_list(
    s: tuple[Any, MemStore, list[bytes], list[int], int, dict[str, Any]],
) -> None:
    native, mem, keys, counts, fresh_after, _ = s
    want = sorted(mem.walk(keys, counts, fresh_after))
    forms: list[Any] = [array("i", counts), tuple(counts), memoryview(array("i", counts))]
    if all(0 <= x < 256 for x in counts):
        forms += [bytes(counts), bytearray(counts)]
    for form in forms:
        assert sorted(native.walk(keys, form, fresh_after)) == want
        assert sorted(mem.walk(keys, form, fresh_after)) == want
        assert sorted(native.walk(b"".join(keys), form, fresh_after)) == want


@needs_blockmap
def test_walk_ranked_argument_checks() -> None:
    assert BLOCKMAP is not None
    store = BLOCKMAP.BlockMap()
    with pytest.raises(TypeError):
        store.walk_ranked([k8(0)], [16], 0)  # no ranker
    store.upsert(k8(0), 0, 16, NOW, 1)
    with pytest.raises(TypeError):
        store.walk([k8(0)], array("d", [1.0]), 0)  # only int counts
    assert store.walk_ranked([k8(1)], b"\x10", 0, compiled(case(["r"]))) == (0, [], None)


@given(st.binary(max_size=200))
def test_packed_seed_equals_twin(packed: bytes) -> None:
    assert RANK is not None
    from inferencecache.index.ranking import _seed_of_packed

    assert RANK.packed_seed(packed) == _seed_of_packed(packed)
    with pytest.raises(TypeError):
        RANK.packed_seed(bytearray(packed))
