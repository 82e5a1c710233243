"""The storage Protocol of the index: the holds of one partition.

A partition is one ``(tenant, model, hash_scheme, adapter)``; inside it a *key* is a prefix hash
(opaque bytes of any length, almost always 8) and a *hold* is ``(key, replica)`` with its
metadata. Everything above this Protocol (views, scoring, policy, eviction order) lives in the
index proper, so a backend only stores, finds and removes holds. Two backends implement it and
pass the same test suite: the compiled in-memory map (``nativestore``) and its pure-Python twin
(``memstore``); a shared backend (Redis/Valkey) would be a third.

Conventions for every method:
- ``replica`` is a small non-negative int interned by the index (never a string here).
- times are int microseconds (UTC wall clock); a hold is *fresh* iff ``last_seen > fresh_after``
  (the caller passes ``now - ttl``), matching ``freshness > 0`` of contract §5.4.
- token counts are int32; sums wrap as two's complement (contract §5.5 "Integers").
- ``tier`` is the stored (normalised) tier: 1, 2, 3, a raw future value > 3, or 2**31-1.
- calls are atomic with respect to each other (the index serialises them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

NEW_KEY = 1
"""``upsert`` bit: the key did not exist before."""
NEW_HOLD = 2
"""``upsert`` bit: the (key, replica) hold did not exist before."""
HOLD_REMOVED = 1
"""``remove_hold`` bit: a hold was removed."""
KEY_REMOVED = 2
"""``remove_hold`` bit: that was the key's last hold, so the key is gone too."""


class Run(NamedTuple):
    """One replica's leading run over a request chain (contract §5.5)."""

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


class RunRanker(Protocol):
    """What ``walk_ranked`` hands the runs to (``ranking.PyRanker``, ``_rank.Ranker``)."""

    def rank(self, rows: list[Run], chain: bool, /, *args: Any) -> Any: ...


class PartitionStore(Protocol):
    """Holds of one partition: key bytes -> replica -> (tokens, last_seen, tier, access)."""

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

    def upsert_many(
        self,
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
        ...

    def holders(self, key: bytes, fresh_after: int) -> list[tuple[int, int, int, int]]:
        """Fresh holds of one key as ``(replica, tokens, last_seen, tier)``, any order."""
        ...

    def walk(
        self, keys: Sequence[bytes] | bytes, counts: Sequence[int], fresh_after: int
    ) -> list[Run]:
        """Leading runs of a request chain (contract §5.5), one per replica that held block 0.

        ``keys`` is a sequence of key bytes, or one bytes object of concatenated 8-byte keys.
        ``counts[i]`` is the request's token count of block i. Block 0 seeds a run for each fresh
        holder; block i continues the runs whose replica freshly holds it; a run that misses a
        block is final. Stops as soon as no run continues. Runs are returned in any order,
        including runs whose wrapped token sum is <= 0 (the caller drops those).
        """
        ...

    def walk_ranked(
        self,
        keys: Sequence[bytes] | bytes,
        counts: Sequence[int],
        fresh_after: int,
        ranker: RunRanker,
        rank_args: tuple[Any, ...],
    ) -> Any:
        """``ranker.rank(self.walk(keys, counts, fresh_after), True, *rank_args)``.

        The lookup's walk and scoring step (``ranking.PyRanker``) in one call, so a compiled
        store can hand its runs to a compiled ranker without creating ``Run`` objects. The
        store does not interpret ``rank_args``.
        """
        ...

    def credit(self, keys: Sequence[bytes] | bytes, blocks: int, replica: int) -> None:
        """LFU credit: ``access += 1`` on the replica's hold of each of ``keys[:blocks]``."""
        ...

    def remove_hold(self, key: bytes, replica: int) -> int:
        """Remove one hold; returns ``HOLD_REMOVED | KEY_REMOVED`` bits (0 if absent)."""
        ...

    def remove_holds(self, keys: Sequence[bytes] | bytes, replica: int) -> tuple[int, int]:
        """``remove_hold`` for each key in order (a batched ``PREFIX_EVICTED``); ``keys`` as in
        ``upsert_many``. Returns (holds removed, keys removed)."""
        ...

    def remove_replica(self, replica: int) -> tuple[int, int]:
        """Remove every hold of a replica; returns (holds removed, keys removed)."""
        ...

    def remove_key(self, key: bytes) -> list[int]:
        """Remove a whole key; returns the replicas whose holds went with it."""
        ...

    def sweep(self, stale_at_or_before: int) -> tuple[dict[int, int], int]:
        """Remove holds with ``last_seen <= stale_at_or_before``.

        Returns (holds removed per replica, keys removed).
        """
        ...

    def cap_candidates(self, k: int, lfu: bool) -> list[tuple[int, int, bytes, int]]:
        """Eviction candidates for the global hold cap (contract §6.3).

        ``(effective_count, last_seen, key, replica)`` for the ``k`` smallest holds by
        ``(effective_count, last_seen)`` plus every further hold tied with the k-th, so the
        caller can finish the order with the full-key tie-break. ``effective_count`` is the
        access count when ``lfu`` else 0.
        """
        ...

    def quota_candidates(self, k: int) -> list[tuple[int, bytes]]:
        """Whole-key candidates for a tenant quota (contract §6.5).

        ``(newest last_seen over the key's holds, key)`` for the ``k`` keys with the smallest
        newest-last_seen plus every further key tied with the k-th.
        """
        ...

    def replica_summary(self) -> dict[int, tuple[int, int]]:
        """Per replica: (holds, newest last_seen). Used by /snapshot and tests."""
        ...

    def holds(self) -> Iterator[Hold]:
        """Every hold (any order). For snapshots, invariants checks and tests; not hot."""
        ...
