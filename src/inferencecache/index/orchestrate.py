"""Index orchestration of one lookup (contract-and-index.md §5.3): exact and chain matching over one
partition, scored and ranked (contract-and-index.md §5.4-§5.5, G1), else TENANT_HOT (§5.6), else the
miss classifier (contract-and-index.md §5.7). Runs under the index lock (``Index.run_locked``); the
Router and the ``/probe`` self-test both call ``orchestrate``.

One store call per match: ``holders`` then one ranker call, or the ``walk_ranked`` capability
(the walk and the ranker in one call: the compiled store hands its runs to the compiled ranker
as C structs). The ranker scores, orders and G1-filters the rows and builds the ``ReplicaScore``
objects, so there is no per-block and no per-row Python work here. Whatever the compiled ranker
declines (NaN scores, out-of-range integers) the Python reference ranks, counted in
``accelerators.FALLBACKS["rank"]``.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferencecache import accelerators
from inferencecache.index.model import Reason, ReplicaScore
from inferencecache.index.ranking import Ranked, Rankers, classify, tenant_hot
from inferencecache.index.settings import IndexSettings
from inferencecache.index.state import IndexState, Partition, PartKey

Orchestrated = tuple[str | None, list[ReplicaScore], list[tuple[int, int]] | None, Partition | None]
"""(strategy, or None for StrategyNone; ranked scores after G1; LFU credit or None; the matched
partition)."""

_PREFIX_MATCH = Reason.PREFIX_MATCH
_TENANT_HOT = Reason.TENANT_HOT


def orchestrate(
    st: IndexState,
    rankers: Rankers,
    settings: IndexSettings,
    key: PartKey,
    keys: Sequence[bytes] | bytes | None,
    counts: Sequence[int],
    exact_hash: bytes,
    now_us: int,
    ttft_ms: int,
) -> Orchestrated:
    """contract-and-index.md §5.3 for the partition ``key`` = (tenant, model, scheme, adapter):
    chain matching of ``keys`` with their token ``counts`` when not None (leading runs from block 0,
    contract-and-index.md §5.5, the chain-path DP), else exact matching of ``exact_hash`` (every
    fresh hold: matched = stored count, DP's ``match`` = the number of fresh holders)."""
    tenant, model, scheme, _adapter = key
    if not tenant or not model or not scheme:
        return None, [], None, None
    part = st.parts.get(key)
    if part is not None:
        total = len(st.serving.get(part.scope, ()))
        stats = st.stats.get(part.tm)
        fresh_after = now_us - rankers.settings.ttl_us
        ranker = rankers.ranker.bind(now_us, total, stats, ttft_ms)
        ranked: Ranked | None = None
        if keys is not None:
            ranked = part.ops.walk_ranked(keys, counts, fresh_after, ranker)
            if ranked is None:
                accelerators.fell_back("rank")
                twin = rankers.twin.bind(now_us, total, stats, ttft_ms)
                ranked = twin.rank(part.store.walk(keys, counts, fresh_after), True)
        else:
            holders = part.store.holders(exact_hash, fresh_after)
            if holders:
                ranked = ranker.rank(holders, False)
                if ranked is None:
                    accelerators.fell_back("rank")
                    ranked = rankers.twin.bind(now_us, total, stats, ttft_ms).rank(holders, False)
        if ranked is not None and ranked[0]:
            return _PREFIX_MATCH, ranked[1], ranked[2], part
    if keys is None:  # chain requests never fall back to TENANT_HOT
        slo = rankers.settings.slo(ttft_ms)
        hot = tenant_hot(st, settings, tenant, model, scheme, now_us, slo)
        if hot:
            scores = [ReplicaScore(r.replica_id, r.score, r.matched, r.prob, r.tier) for r in hot]
            return _TENANT_HOT, scores, None, None
    return classify(st, tenant, model, scheme), [], None, None


def credit(
    part: Partition,
    credit: list[tuple[int, int]],
    keys: Sequence[bytes] | bytes | None,
    exact_hash: bytes,
) -> None:
    """contract-and-index.md §5.10: +1 access on every contributing hold of every returned
    replica."""
    store = part.store
    for rid, blocks in credit:
        if blocks <= 0:
            continue
        if keys is not None:
            store.credit(keys, blocks, rid)
        else:
            store.credit((exact_hash,), 1, rid)
