"""Exact and chain matching over one partition, scored (contract §5.4-§5.5).

One store call per lookup (``holders`` or ``walk``), then per-replica scoring: no per-block
Python work here.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferencecache.index.ingest import f32, report_tier
from inferencecache.index.ranking import (
    Row,
    chain_dp,
    dp_factor,
    fresh_pressure,
    freshness,
    prefix_match_score,
    pressure_factor,
    rank,
)
from inferencecache.index.settings import IndexSettings
from inferencecache.index.state import IndexState, Partition


def match_exact(
    st: IndexState,
    settings: IndexSettings,
    part: Partition,
    key: bytes,
    ttl_us: int,
    now_us: int,
    slo: float,
) -> list[Row]:
    """Every fresh hold of ``key``: matched = stored count, prob = freshness, the hold's tier.
    DP's ``match`` is the number of scored holders."""
    fresh_after = now_us - ttl_us
    holders = part.store.holders(key, fresh_after)
    if not holders:
        return []
    total = len(st.serving.get(part.scope, ()))
    dp = dp_factor(len(holders), total)
    stats_rows = st.stats.get(part.tm)
    names = st.replicas.names
    rows: list[Row] = []
    for rid, tokens, last_seen, tier in holders:
        f = f32(freshness(now_us - last_seen, ttl_us))
        if f <= 0.0:
            continue
        pf = pressure_factor(settings, fresh_pressure(stats_rows, rid, fresh_after))
        score = prefix_match_score(tokens, f, pf, slo, dp)
        rows.append(
            Row(score, names[rid] or "", tokens, f, report_tier(tier), rid, 1 if tokens > 0 else 0)
        )
    rank(rows)
    return rows


def match_chain(
    st: IndexState,
    settings: IndexSettings,
    part: Partition,
    keys: Sequence[bytes] | bytes,
    counts: Sequence[int],
    ttl_us: int,
    now_us: int,
    slo: float,
) -> list[Row]:
    """Leading runs from block 0 (§5.5) with tokens > 0, scored with the chain-path DP."""
    fresh_after = now_us - ttl_us
    runs = part.store.walk(keys, counts, fresh_after)
    if not runs:
        return []
    names = st.replicas.names
    rows: list[Row] = []
    for run in runs:
        if run.tokens <= 0:
            continue
        f = f32(freshness(now_us - run.oldest, ttl_us))
        if f <= 0.0:
            continue
        rows.append(
            Row(
                0.0,
                names[run.replica] or "",
                run.tokens,
                f,
                report_tier(run.tier),
                run.replica,
                run.blocks,
            )
        )
    if not rows:
        return rows
    total = len(st.serving.get(part.scope, ()))
    stats_rows = st.stats.get(part.tm)
    for row, dp in zip(rows, chain_dp(rows, total), strict=True):
        pf = pressure_factor(settings, fresh_pressure(stats_rows, row.rid, fresh_after))
        row.score = prefix_match_score(row.matched, row.prob, pf, slo, dp)
    rank(rows)
    return rows
