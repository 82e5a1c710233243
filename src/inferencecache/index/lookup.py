"""Exact and chain matching over one partition, scored and ranked (contract §5.4-§5.5, G1).

One store call per lookup: ``holders`` then one ranker call, or ``walk_ranked`` (the walk and
the ranker in one call: the compiled store hands its runs to the compiled ranker as C structs).
The ranker scores, orders and G1-filters the rows and builds the ``ReplicaScore`` objects, so
there is no per-block and no per-row Python work here. The ranker is the compiled
``_rank.Ranker`` when built, else ``ranking.PyRanker``; the compiled one answers None for inputs
it does not mirror exactly (NaN scores, out-of-range integers), and the twin then runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inferencecache.index.model import ReplicaScore
from inferencecache.index.state import IndexState, Partition

Ranked = tuple[int, list[ReplicaScore], list[tuple[int, int]] | None]
"""(rows scored before G1, ranked scores passing G1, (replica id, blocks) to credit or None)."""


def rank_args(
    st: IndexState,
    names: Sequence[str | None],
    part: Partition,
    now_us: int,
    ttl_us: int,
    pressure_weight: float,
    slo: float,
    min_matched: int,
    want_credit: bool,
) -> tuple[Any, ...]:
    """The ranker's arguments after ``(rows, chain)`` for one partition."""
    total = len(st.serving.get(part.scope, ()))
    stats = st.stats.get(part.tm)
    return (names, now_us, ttl_us, total, stats, pressure_weight, slo, min_matched, want_credit)


def match_exact(
    ranker: Any,
    twin: Any,
    part: Partition,
    key: bytes,
    fresh_after: int,
    args: tuple[Any, ...],
) -> Ranked | None:
    """Every fresh hold of ``key``: matched = stored count, prob = freshness, the hold's tier.
    DP's ``match`` is the number of fresh holders. None when nothing was scored."""
    holders = part.store.holders(key, fresh_after)
    if not holders:
        return None
    res: Ranked | None = ranker.rank(holders, False, *args)
    if res is None:
        res = twin.rank(holders, False, *args)
    return res if res is not None and res[0] else None


def match_chain(
    ranker: Any,
    twin: Any,
    part: Partition,
    keys: Sequence[bytes] | bytes,
    counts: Sequence[int],
    fresh_after: int,
    args: tuple[Any, ...],
) -> Ranked | None:
    """Leading runs from block 0 (§5.5) with tokens > 0, scored with the chain-path DP.
    None when nothing was scored."""
    store = part.store
    res: Ranked | None = store.walk_ranked(keys, counts, fresh_after, ranker, args)
    if res is None:
        res = twin.rank(store.walk(keys, counts, fresh_after), True, *args)
    return res if res is not None and res[0] else None
