"""The storage Protocol of the index: the holds of one partition.

A partition is one ``(tenant, model, hash_scheme, adapter)``; inside it a *key* is a prefix hash
(opaque bytes of any length, almost always 8) and a *hold* is ``(key, replica)`` with its
metadata. Everything above this Protocol (views, scoring, policy, eviction order) lives in the
index proper, so a backend only stores, finds and removes holds.

``PartitionStore`` is the handful of operations every backend implements. The batch and bulk
operations, the ranked walk and the eviction candidates are *capabilities*: a backend that has
one (a method of that name) is called directly, any other gets the plain Python default below,
built on the required operations (``PartitionOps`` binds either once per partition). Two
backends pass the same test suite: ``memstore`` (pure Python, the required operations only, so
the suite exercises every default) and the compiled ``nativestore`` (every capability in C); a
shared backend (Redis/Valkey) would be a third (docs/development.md, "Add a store backend").

Conventions for every method:
- ``replica`` is a small non-negative int interned by the index (never a string here).
- times are int microseconds (UTC wall clock); a hold is *fresh* iff ``last_seen > fresh_after``
  (the caller passes ``now - ttl``), matching ``freshness > 0`` of contract-and-index.md §5.4.
- token counts are int32; sums wrap as two's complement (contract-and-index.md §5.5 "Integers").
- ``tier`` is the stored (normalised) tier: 1, 2, 3, a raw future value > 3, or 2**31-1.
- calls are atomic with respect to each other (the index serialises them).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Final, NamedTuple, Protocol

from inferencecache.fingerprint import split_packed

NEW_KEY = 1
"""``upsert`` bit: the key did not exist before."""
NEW_HOLD = 2
"""``upsert`` bit: the (key, replica) hold did not exist before."""
HOLD_REMOVED = 1
"""``remove_hold`` bit: a hold was removed."""
KEY_REMOVED = 2
"""``remove_hold`` bit: that was the key's last hold, so the key is gone too."""


class Run(NamedTuple):
    """One replica's leading run over a request chain (contract-and-index.md §5.5)."""

    replica: int
    tokens: int  # sum of the request's counts over the run, int32-wrapped
    oldest: int  # min last_seen over the run's holds
    tier: int  # max stored tier over the run's holds (max = coldest, see module doc)
    blocks: int  # run length in blocks


class Hold(NamedTuple):
    key: bytes
    replica: int
    tokens: int
    last_seen: int
    tier: int
    access: int


class BoundRanker(Protocol):
    """A ranker bound to one lookup (``ranking.PyBoundRanker``, ``_rank.BoundRanker``), which
    ``walk_ranked`` hands the runs to; the store does not interpret it."""

    def rank(self, rows: list[Run], chain: bool, /) -> Any: ...


class PartitionStore(Protocol):
    """Holds of one partition: key bytes -> replica -> (tokens, last_seen, tier, access).
    The operations every backend implements (see the module doc for the optional ones)."""

    def key_count(self) -> int:
        """Distinct keys (a key exists iff it has at least one hold)."""
        ...

    def hold_count(self) -> int:
        """Holds (key, replica pairs)."""
        ...

    def upsert(self, key: bytes, replica: int, tokens: int, last_seen: int, tier: int) -> int:
        """Create or refresh one hold; overwrite tokens, last_seen and tier, keep access.

        Returns ``NEW_KEY | NEW_HOLD`` bits. A new hold starts with access 0.
        """
        ...

    def holders(self, key: bytes, fresh_after: int) -> list[tuple[int, int, int, int]]:
        """Fresh holds of one key as ``(replica, tokens, last_seen, tier)``, any order."""
        ...

    def walk(
        self, keys: Sequence[bytes] | bytes, counts: Sequence[int], fresh_after: int
    ) -> list[Run]:
        """Leading runs of a request chain (contract-and-index.md §5.5), one per replica that held
        block 0.

        ``keys`` is a sequence of key bytes, or one bytes object of concatenated 8-byte keys.
        ``counts[i]`` is the request's token count of block i. Block 0 seeds a run for each fresh
        holder; block i continues the runs whose replica freshly holds it; a run that misses a
        block is final. Stops as soon as no run continues. Runs are returned in any order,
        including runs whose wrapped token sum is <= 0 (the caller drops those).
        """
        ...

    def credit(self, keys: Sequence[bytes] | bytes, blocks: int, replica: int) -> None:
        """LFU credit: ``access += 1`` on the replica's hold of each of ``keys[:blocks]``."""
        ...

    def remove_hold(self, key: bytes, replica: int) -> int:
        """Remove one hold; returns ``HOLD_REMOVED | KEY_REMOVED`` bits (0 if absent)."""
        ...

    def holds(self) -> Iterator[Hold]:
        """Every hold (any order; safe to remove holds while iterating)."""
        ...


# ---------------------------------------------------------------------------------------------
# Optional capabilities: the plain Python defaults


def split_keys(keys: Sequence[bytes] | bytes) -> Sequence[bytes]:
    """Packed 8-byte keys -> a list (a trailing partial key is ignored); a sequence as is."""
    if isinstance(keys, bytes):
        return split_packed(keys[: len(keys) - len(keys) % 8])
    return keys


def upsert_many(
    store: PartitionStore,
    keys: Sequence[bytes] | bytes,
    tokens: Sequence[int],
    replica: int,
    last_seen: int,
    tier: int,
) -> tuple[int, int]:
    """``upsert`` for each ``(keys[i], tokens[i])`` in order; returns (new keys, new holds).

    ``keys`` is a sequence of key bytes, or one bytes object of concatenated 8-byte keys (the
    server's compact ingest form). Pairs up to the shorter of the two (``zip``).
    """
    new_keys = new_holds = 0
    upsert = store.upsert
    for key, tok in zip(split_keys(keys), tokens, strict=False):
        bits = upsert(key, replica, tok, last_seen, tier)
        new_keys += bits & NEW_KEY
        new_holds += (bits & NEW_HOLD) >> 1
    return new_keys, new_holds


def remove_holds(
    store: PartitionStore, keys: Sequence[bytes] | bytes, replica: int
) -> tuple[int, int]:
    """``remove_hold`` for each key in order (a batched ``PREFIX_EVICTED``); ``keys`` as in
    ``upsert_many``. Returns (holds removed, keys removed)."""
    seq = split_keys(keys)
    for key in seq:
        if not isinstance(key, bytes):
            raise TypeError(f"a key must be bytes, not {type(key).__name__}")
    holds = gone = 0
    for key in seq:
        bits = store.remove_hold(key, replica)
        holds += bits & HOLD_REMOVED
        gone += (bits & KEY_REMOVED) >> 1
    return holds, gone


def remove_replica(store: PartitionStore, replica: int) -> tuple[int, int]:
    """Remove every hold of a replica; returns (holds removed, keys removed)."""
    return remove_holds(store, [h.key for h in store.holds() if h.replica == replica], replica)


def remove_key(store: PartitionStore, key: bytes) -> list[int]:
    """Remove a whole key; returns the replicas whose holds went with it."""
    replicas = [h.replica for h in store.holds() if h.key == key]
    for r in replicas:
        store.remove_hold(key, r)
    return replicas


def sweep(store: PartitionStore, stale_at_or_before: int) -> tuple[dict[int, int], int]:
    """Remove holds with ``last_seen <= stale_at_or_before``.

    Returns (holds removed per replica, keys removed).
    """
    per_replica: dict[int, int] = {}
    gone = 0
    for h in [h for h in store.holds() if h.last_seen <= stale_at_or_before]:
        bits = store.remove_hold(h.key, h.replica)
        if bits:
            per_replica[h.replica] = per_replica.get(h.replica, 0) + 1
            gone += (bits & KEY_REMOVED) >> 1
    return per_replica, gone


def walk_ranked(
    store: PartitionStore,
    keys: Sequence[bytes] | bytes,
    counts: Sequence[int],
    fresh_after: int,
    ranker: BoundRanker,
) -> Any:
    """``ranker.rank(store.walk(keys, counts, fresh_after), True)``: the lookup's walk and
    scoring step in one call, so a compiled store can hand its runs to a compiled ranker
    without creating ``Run`` objects."""
    return ranker.rank(store.walk(keys, counts, fresh_after), True)


def cap_candidates(store: PartitionStore, k: int, lfu: bool) -> list[tuple[int, int, bytes, int]]:
    """Eviction candidates for the global hold cap (contract-and-index.md §6.3).

    ``(effective_count, last_seen, key, replica)`` for the ``k`` smallest holds by
    ``(effective_count, last_seen)`` plus every further hold tied with the k-th, so the
    caller can finish the order with the full-key tie-break. ``effective_count`` is the
    access count when ``lfu`` else 0.
    """
    if k <= 0:
        return []
    every = [((h.access if lfu else 0), h.last_seen, h.key, h.replica) for h in store.holds()]
    if len(every) <= k:
        return every
    best = heapq.nsmallest(k, every, key=lambda c: (c[0], c[1]))
    edge = (best[-1][0], best[-1][1])
    return [c for c in every if (c[0], c[1]) <= edge]


def quota_candidates(store: PartitionStore, k: int) -> list[tuple[int, bytes]]:
    """Whole-key candidates for a tenant quota (contract-and-index.md §6.5).

    ``(newest last_seen over the key's holds, key)`` for the ``k`` keys with the smallest
    newest-last_seen plus every further key tied with the k-th.
    """
    if k <= 0:
        return []
    newest: dict[bytes, int] = {}
    for h in store.holds():
        if h.last_seen > newest.get(h.key, -(2**63) - 1):
            newest[h.key] = h.last_seen
    every = [(ts, key) for key, ts in newest.items()]
    if len(every) <= k:
        return every
    edge = heapq.nsmallest(k, every, key=lambda c: c[0])[-1][0]
    return [c for c in every if c[0] <= edge]


def replica_summary(store: PartitionStore) -> dict[int, tuple[int, int]]:
    """Per replica: (holds, newest last_seen). Used by /snapshot and tests."""
    out: dict[int, tuple[int, int]] = {}
    for h in store.holds():
        cur = out.get(h.replica)
        if cur is None:
            out[h.replica] = (1, h.last_seen)
        else:
            out[h.replica] = (cur[0] + 1, max(cur[1], h.last_seen))
    return out


Columns = tuple[bytes, bytes, bytes, bytes, bytes, list[tuple[bytes, int, int, int, int]]]
"""``dump_columns``: every hold of an 8-byte key as native-order columns (keys, replicas u32,
tokens i32, last_seen i64, tiers i32), every other hold as a (key, replica, tokens, last_seen,
tier) tuple."""


def dump_columns(store: PartitionStore) -> Columns:
    """Every hold as columns (event-log snapshots: the compiled store copies them in one pass
    under the index lock; this default walks ``holds()``)."""
    keys = bytearray()
    reps, toks, tss, tiers = array("I"), array("i"), array("q"), array("i")
    others: list[tuple[bytes, int, int, int, int]] = []
    for h in store.holds():
        if len(h.key) == 8:
            keys += h.key
            reps.append(h.replica)
            toks.append(h.tokens)
            tss.append(h.last_seen)
            tiers.append(h.tier)
        else:
            others.append((h.key, h.replica, h.tokens, h.last_seen, h.tier))
    return (bytes(keys), reps.tobytes(), toks.tobytes(), tss.tobytes(), tiers.tobytes(),
            others)


def reserve(store: PartitionStore, keys: int) -> None:
    """Make room for ``keys`` more keys at once (a snapshot load knows how many are coming);
    the default does nothing."""


OPTIONAL: Final = (
    "upsert_many", "remove_holds", "remove_replica", "remove_key", "sweep", "walk_ranked",
    "cap_candidates", "quota_candidates", "replica_summary", "dump_columns", "reserve",
)  # fmt: skip
"""The capabilities a backend may implement itself (same name and signature, minus ``store``)."""


class PartitionOps:
    """One partition's store as the full interface, bound once: the required operations are
    the store's methods, each capability the store's own method when it has one, else the
    default above. The index calls the store through this (``Partition.ops``)."""

    __slots__ = (
        "credit", "hold_count", "holders", "holds", "key_count", "remove_hold", "store",
        "upsert", "walk", *OPTIONAL,
    )  # fmt: skip

    def __init__(self, store: PartitionStore) -> None:
        self.store = store
        self.key_count = store.key_count
        self.hold_count = store.hold_count
        self.upsert = store.upsert
        self.holders = store.holders
        self.walk = store.walk
        self.credit = store.credit
        self.remove_hold = store.remove_hold
        self.holds = store.holds
        self.upsert_many: Callable[..., tuple[int, int]] = _bind(store, upsert_many)
        self.remove_holds: Callable[..., tuple[int, int]] = _bind(store, remove_holds)
        self.remove_replica: Callable[[int], tuple[int, int]] = _bind(store, remove_replica)
        self.remove_key: Callable[[bytes], list[int]] = _bind(store, remove_key)
        self.sweep: Callable[[int], tuple[dict[int, int], int]] = _bind(store, sweep)
        self.walk_ranked: Callable[..., Any] = _bind(store, walk_ranked)
        self.cap_candidates: Callable[..., list[tuple[int, int, bytes, int]]] = _bind(
            store, cap_candidates
        )
        self.quota_candidates: Callable[[int], list[tuple[int, bytes]]] = _bind(
            store, quota_candidates
        )
        self.replica_summary: Callable[[], dict[int, tuple[int, int]]] = _bind(
            store, replica_summary
        )
        self.dump_columns: Callable[[], Columns] = _bind(store, dump_columns)
        self.reserve: Callable[[int], None] = _bind(store, reserve)


def _bind(store: PartitionStore, default: Callable[..., Any]) -> Callable[..., Any]:
    own: Callable[..., Any] | None = getattr(store, default.__name__, None)
    return own if own is not None else partial(default, store)
