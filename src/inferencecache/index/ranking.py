"""Scores, DP, TENANT_HOT candidates, the miss classifier, gates and affinity
(contract-and-index.md §5.4-§5.9).

Scores follow the reference's float32 arithmetic: freshness and the other factors are computed
in float64, narrowed to float32, and multiplied left to right as written with a float32
rounding after each product (``f32``), so ties and scores sitting exactly on a floor come out as
the reference's. Factors equal to 1 skip their multiplication (exact either way).
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from inferencecache import accelerators
from inferencecache.index.apply import f32, report_tier
from inferencecache.index.model import Reason, ReplicaScore
from inferencecache.index.settings import IndexSettings
from inferencecache.index.state import IndexState, StatsRow
from inferencecache.index.tenant_config import EffectivePolicy

if TYPE_CHECKING:
    from inferencecache.index import _rank


class Row:
    """A scored replica while ranking. ``blocks`` = holds to LFU-credit: the run length on the
    chain path, 1 or 0 on the exact path, 0 for TENANT_HOT."""

    __slots__ = ("blocks", "matched", "prob", "replica_id", "rid", "score", "tier")

    def __init__(
        self,
        score: float,
        replica_id: str,
        matched: int,
        prob: float,
        tier: int,
        rid: int,
        blocks: int,
    ) -> None:
        self.score = score
        self.replica_id = replica_id
        self.matched = matched
        self.prob = prob
        self.tier = tier
        self.rid = rid
        self.blocks = blocks

    def __repr__(self) -> str:
        return (
            f"Row({self.replica_id!r}, score={self.score}, matched={self.matched}, "
            f"prob={self.prob}, tier={self.tier})"
        )


def freshness(age_us: int, ttl_us: int) -> float:
    """contract-and-index.md §5.4: 1 at age <= 0, 0 at age >= ttl, linear between (float64)."""
    if age_us <= 0:
        return 1.0
    if age_us >= ttl_us:
        return 0.0
    return 1.0 - age_us / ttl_us


def dp_factor(match: int, total: int) -> float:
    """contract-and-index.md §5.4 DP: 1 if total <= 1 or match < 0; 0 if match >= total; else 1 -
    match/total."""
    if total <= 1 or match < 0:
        return 1.0
    if match >= total:
        return 0.0
    return 1.0 - match / total


def slo_coeff(settings: IndexSettings, ttft_ms: int) -> float:
    tight = settings.slo_tight_ttft_ms
    bias = settings.slo_tight_bias
    if tight > 0 and bias > 0 and 0 < ttft_ms < tight:
        return f32(bias)
    return 0.0


def pressure_factor(settings: IndexSettings, pressure: float) -> float:
    return _pressure_factor(settings.pressure_weight, pressure)


def _pressure_factor(weight: float, pressure: float) -> float:
    pf = 1.0 - weight * pressure
    if pf <= 0.0:
        return 0.0
    if pf >= 1.0:
        return 1.0
    return f32(pf)


def prefix_match_score(matched: int, f: float, pf: float, slo: float, dp: float) -> float:
    """``matched * f * pressure_factor * (1 + f*slo) * DP`` in float32
    (contract-and-index.md §5.4)."""
    s = f32(f32(float(matched)) * f) if f != 1.0 else f32(float(matched))
    if pf != 1.0:
        s = f32(s * pf)
    if slo:
        s = f32(s * f32(1.0 + f32(f * slo)))
    if dp != 1.0:
        s = f32(s * f32(dp))
    return s


def tenant_hot_score(hit_rate: float, recency: float, pf: float, slo: float) -> float:
    """``hit_rate * recency * pressure_factor * (1 + recency*slo)`` in float32
    (contract-and-index.md §5.4)."""
    s = f32(hit_rate * recency)
    if pf != 1.0:
        s = f32(s * pf)
    if slo:
        s = f32(s * f32(1.0 + f32(recency * slo)))
    return s


def fresh_pressure(rows: dict[int, StatsRow] | None, rid: int, fresh_after: int) -> float:
    """PREFIX_MATCH pressure: the row's value if ``stats_reported`` is within the TTL, else 0."""
    if rows is None:
        return 0.0
    row = rows.get(rid)
    if row is None or row.stats_reported <= fresh_after:
        return 0.0
    return row.pressure


def _rank_key(r: Row) -> tuple[float, str]:
    return (-r.score, r.replica_id)


def rank(rows: list[Row]) -> None:
    """Order best first: score descending, ties by replica_id ascending (UTF-8 = str order)."""
    if len(rows) > 1:
        rows.sort(key=_rank_key)


def chain_dp(rows: list[Row], total: int) -> list[float]:
    """Chain-path DP per row: ``match`` = rows with matched >= this row's matched."""
    if total <= 1:
        return [1.0] * len(rows)
    matched = sorted(r.matched for r in rows)
    n = len(matched)
    return [dp_factor(n - bisect_left(matched, r.matched), total) for r in rows]


@dataclass(frozen=True, slots=True, eq=False)
class RankSettings:
    """Every knob the PREFIX_MATCH scoring step reads: the server's settings and one tenant's
    policy, resolved once per policy (``RankSettings.of``) and handed to a ranker when it is
    built, so a lookup passes only its own facts. A new scoring knob is one field here, one
    line in ``of``, its use in ``PyRanker`` and in ``_rank.c`` (docs/development.md).

    Identity equality (``eq=False``): a ranker cache is keyed by the object.
    """

    ttl_us: int  # the tenant's TTL: freshness is 0 at this age (contract-and-index.md §5.4)
    pressure_weight: float  # pressure_factor = 1 - weight * pressure (contract-and-index.md §5.4)
    slo_tight_ttft_ms: int  # a request with 0 < ttft_ms < this gets the SLO bias
    slo_bias: float  # the float32 SLO bias, 0.0 when the bias is off
    min_matched: int  # G1 (contract-and-index.md §5.8): fewer matched tokens are cut; 0 = off
    credit: bool  # return the LFU credit list (LFU tenants, contract-and-index.md §5.10)

    @classmethod
    def of(cls, settings: IndexSettings, policy: EffectivePolicy) -> RankSettings:
        tight, bias = settings.slo_tight_ttft_ms, settings.slo_tight_bias
        return cls(
            ttl_us=policy.ttl_us,
            pressure_weight=settings.pressure_weight,
            slo_tight_ttft_ms=tight,
            slo_bias=f32(bias) if tight > 0 and bias > 0 else 0.0,
            min_matched=policy.minimum_matched_tokens,
            credit=policy.lfu,
        )

    def slo(self, ttft_ms: int) -> float:
        """The SLO coefficient of a request (``slo_coeff``)."""
        return self.slo_bias if 0 < ttft_ms < self.slo_tight_ttft_ms else 0.0


Ranked = tuple[int, list[ReplicaScore], list[tuple[int, int]] | None]
"""(rows scored before G1, ranked scores passing G1, (replica id, blocks) to credit or None)."""


class PyRanker:
    """The PREFIX_MATCH scoring step (contract-and-index.md §5.4, §5.5, G1 of §5.8) in Python: the
    reference of the compiled ``_rank.Ranker`` and its fallback (the compiled one returns None for
    inputs it does not mirror exactly, and the caller then runs this).

    ``PyRanker(names, settings)``: ``names`` is the index's replica id -> name list (read at
    each call), ``settings`` the policy's ``RankSettings``. ``bind(now_us, total, stats,
    ttft_ms)`` gives the ranker of one lookup (``total``: the DP denominator, ``stats``: the
    ``(tenant, model)`` stats rows or None); its ``rank(rows, chain)`` takes the store's answer
    (``walk`` Runs when ``chain``, else ``holders`` tuples) and returns ``Ranked``: the number
    of scored rows before G1, the ranked ``ReplicaScore`` objects that pass G1, and when
    ``settings.credit`` the ``(replica id, blocks)`` of each for the LFU credit.
    """

    __slots__ = ("names", "settings")

    def __init__(self, names: Sequence[str | None], settings: RankSettings) -> None:
        self.names = names
        self.settings = settings

    def bind(
        self, now_us: int, total: int, stats: dict[int, StatsRow] | None, ttft_ms: int
    ) -> PyBoundRanker:
        return PyBoundRanker(self, now_us, total, stats, ttft_ms)


class PyBoundRanker:
    """``PyRanker`` bound to one lookup's facts (see there)."""

    __slots__ = ("now_us", "ranker", "stats", "total", "ttft_ms")

    def __init__(
        self,
        ranker: PyRanker,
        now_us: int,
        total: int,
        stats: dict[int, StatsRow] | None,
        ttft_ms: int,
    ) -> None:
        self.ranker = ranker
        self.now_us = now_us
        self.total = total
        self.stats = stats
        self.ttft_ms = ttft_ms

    def rank(self, rows: Sequence[tuple[int, ...]], chain: bool) -> Ranked:
        cfg = self.ranker.settings
        names = self.ranker.names
        now_us, ttl_us, total = self.now_us, cfg.ttl_us, self.total
        fresh_after = now_us - ttl_us
        out: list[Row] = []
        if chain:
            for rid, tokens, oldest, tier, blocks in rows:
                if tokens <= 0:
                    continue
                f = f32(freshness(now_us - oldest, ttl_us))
                if f <= 0.0:
                    continue
                out.append(Row(0.0, names[rid] or "", tokens, f, report_tier(tier), rid, blocks))
            dps = chain_dp(out, total) if out else []
        else:
            dp = dp_factor(len(rows), total)
            for rid, tokens, last_seen, tier in rows:
                f = f32(freshness(now_us - last_seen, ttl_us))
                if f <= 0.0:
                    continue
                blocks = 1 if tokens > 0 else 0
                out.append(Row(0.0, names[rid] or "", tokens, f, report_tier(tier), rid, blocks))
            dps = [dp] * len(out)
        slo = cfg.slo(self.ttft_ms)
        for row, dp in zip(out, dps, strict=True):
            pressure = fresh_pressure(self.stats, row.rid, fresh_after)
            pf = _pressure_factor(cfg.pressure_weight, pressure)
            row.score = prefix_match_score(row.matched, row.prob, pf, slo, dp)
        rank(out)
        scored = len(out)
        if cfg.min_matched > 0:
            out = [r for r in out if r.matched >= cfg.min_matched]
        scores = [ReplicaScore(r.replica_id, r.score, r.matched, r.prob, r.tier) for r in out]
        credit = [(r.rid, r.blocks) for r in out] if cfg.credit else None
        return scored, scores, credit


def tenant_hot(
    st: IndexState,
    settings: IndexSettings,
    tenant: str,
    model: str,
    scheme: str,
    now_us: int,
    slo: float,
) -> list[Row]:
    """contract-and-index.md §5.6 candidates (exact path after a miss): warm stats rows of replicas
    serving the scope."""
    max_age = settings.tenant_hot_max_age_us
    if max_age <= 0:
        return []
    rows = st.stats.get((tenant, model))
    if not rows:
        return []
    serving = st.serving.get((tenant, model, scheme))
    if not serving:
        return []
    min_hit = settings.tenant_hot_min_hit_rate
    names = st.replicas.names
    out: list[Row] = []
    for rid, row in rows.items():
        age = now_us - row.stats_reported
        if age >= max_age or row.hit_rate < min_hit or serving.get(rid, 0) <= 0:
            continue
        recency = 1.0 - age / max_age
        recency = 0.0 if recency < 0.0 else (1.0 if recency > 1.0 else f32(recency))
        pf = pressure_factor(settings, row.pressure)
        score = tenant_hot_score(row.hit_rate, recency, pf, slo)
        out.append(Row(score, names[rid] or "", 0, row.hit_rate, 0, rid, 0))
    rank(out)
    return out


def classify(st: IndexState, tenant: str, model: str, scheme: str) -> str | None:
    """contract-and-index.md §5.7 miss classifier; None = StrategyNone (cold start or novel
    prefix)."""
    if st.total_keys == 0:
        return None
    if not st.keys_by_tenant.get(tenant):
        return Reason.UNKNOWN_TENANT
    if not st.keys_by_tm.get((tenant, model)):
        return Reason.UNKNOWN_MODEL
    if not st.serving.get((tenant, model, scheme)):
        return Reason.UNKNOWN_HASH_SCHEME
    return None


_LEN8 = b"\x00\x00\x00\x08"


def _seed_of_packed(packed: bytes) -> bytes:
    """``concat(u32_be(8) || h)`` over 8-byte hashes, with strided C-level copies."""
    n = len(packed) >> 3
    out = bytearray(12 * n)
    out[3::12] = b"\x08" * n
    for j in range(8):
        out[4 + j :: 12] = packed[j : 8 * n : 8]
    return bytes(out)


def chain_seed(keys: Sequence[bytes] | bytes) -> bytes:
    """contract-and-index.md §5.9 seed of a resolved chain: ``concat(u32_be(len(h)) || h)``."""
    if isinstance(keys, bytes):
        return _packed_seed(keys)
    if set(map(len, keys)) == {8}:
        return _LEN8 + _LEN8.join(keys)
    return b"".join(struct.pack(">I", len(h)) + h for h in keys)


def affinity_pick(seed: bytes, replicas_sorted: Sequence[str]) -> str:
    """contract-and-index.md §5.9: ``replicas[uint64_be(SHA256(seed)[0:8]) mod len(replicas)]``."""
    head = hashlib.sha256(seed).digest()[:8]
    return replicas_sorted[int.from_bytes(head, "big") % len(replicas_sorted)]


class Rankers:
    """The scoring step of one policy: the compiled ranker when built (else the twin) and the
    twin that runs whatever the compiled one declines (counted in ``accelerators.FALLBACKS``).
    Built once per policy (``RankerCache``), never per lookup."""

    __slots__ = ("ranker", "settings", "twin")

    def __init__(self, names: Sequence[str | None], settings: RankSettings) -> None:
        self.settings = settings
        self.twin = PyRanker(names, settings)
        self.ranker: RankerLike = (
            CompiledRanker(names, settings) if CompiledRanker is not None else self.twin
        )

    def bind(
        self, now_us: int, total: int, stats: dict[int, StatsRow] | None, ttft_ms: int
    ) -> tuple[BoundRankerLike, PyBoundRanker]:
        """(ranker, twin) of one lookup."""
        return (
            self.ranker.bind(now_us, total, stats, ttft_ms),
            self.twin.bind(now_us, total, stats, ttft_ms),
        )


class RankerCache:
    """``Rankers`` per policy, built on first use. Keyed by the policy object: a replaced
    configuration brings new ``EffectivePolicy`` objects, and the old entries are dropped
    when the cache grows past ``limit``. Safe to share between threads (a race builds twice)."""

    __slots__ = ("_by_policy", "_limit", "_names", "_settings")

    def __init__(
        self, names: Sequence[str | None], settings: IndexSettings, limit: int = 4096
    ) -> None:
        self._names = names
        self._settings = settings
        self._limit = limit
        self._by_policy: dict[int, tuple[EffectivePolicy, Rankers]] = {}

    def get(self, policy: EffectivePolicy) -> Rankers:
        hit = self._by_policy.get(id(policy))
        if hit is not None and hit[0] is policy:
            return hit[1]
        rankers = Rankers(self._names, RankSettings.of(self._settings, policy))
        if len(self._by_policy) >= self._limit:
            self._by_policy.clear()
        self._by_policy[id(policy)] = (policy, rankers)  # pins the policy: ids stay unique
        return rankers


RankerLike: TypeAlias = "_rank.Ranker | PyRanker"
"""``PyRanker`` or the compiled ``_rank.Ranker`` (same API, see ``_rank.pyi``)."""
BoundRankerLike: TypeAlias = "_rank.BoundRanker | PyBoundRanker"
"""A ranker bound to one lookup; the compiled one's ``rank`` may return None (run the twin)."""

_COMPILED = accelerators.load("inferencecache.index._rank")
CompiledRanker: type[_rank.Ranker] | None = _COMPILED.Ranker if _COMPILED is not None else None
"""The compiled ranker class when built and enabled, else None."""
RANKER_IMPLEMENTATION = "native" if _COMPILED is not None else "python"
_packed_seed: Callable[[bytes], bytes] = (
    _COMPILED.packed_seed if _COMPILED is not None else _seed_of_packed
)
