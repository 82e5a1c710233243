"""Type stub of the compiled PartitionStore (``_blockmap.c``); see ``docs/index-store.md``."""

from collections.abc import Iterator, Sequence
from typing import Any, final

from inferencecache.index.store import BoundRanker, Hold, Run

NEW_KEY: int
NEW_HOLD: int
HOLD_REMOVED: int
KEY_REMOVED: int
FAST_NAMEDTUPLES: int

@final
class BlockMap:
    """Holds of one index partition. Fixed-width fields: replica in 0..2**32-2, tokens and
    tier int32, last_seen int64 (OverflowError outside); access saturates at 2**63-1."""

    def __init__(self) -> None: ...
    def key_count(self) -> int: ...
    def hold_count(self) -> int: ...
    def upsert(self, key: bytes, replica: int, tokens: int, last_seen: int, tier: int) -> int: ...
    def upsert_many(
        self,
        keys: Sequence[bytes] | bytes,
        tokens: Sequence[int],
        replica: int,
        last_seen: int,
        tier: int,
    ) -> tuple[int, int]: ...
    def holders(self, key: bytes, fresh_after: int) -> list[tuple[int, int, int, int]]: ...
    def walk(
        self, keys: Sequence[bytes] | bytes, counts: Sequence[int], fresh_after: int
    ) -> list[Run]: ...
    def walk_ranked(
        self,
        keys: Sequence[bytes] | bytes,
        counts: Sequence[int],
        fresh_after: int,
        ranker: BoundRanker,
    ) -> Any: ...
    def credit(self, keys: Sequence[bytes] | bytes, blocks: int, replica: int) -> None: ...
    def remove_hold(self, key: bytes, replica: int) -> int: ...
    def remove_holds(self, keys: Sequence[bytes] | bytes, replica: int) -> tuple[int, int]: ...
    def remove_replica(self, replica: int) -> tuple[int, int]: ...
    def remove_key(self, key: bytes) -> list[int]: ...
    def sweep(self, stale_at_or_before: int) -> tuple[dict[int, int], int]: ...
    def cap_candidates(self, k: int, lfu: bool) -> list[tuple[int, int, bytes, int]]: ...
    def quota_candidates(self, k: int) -> list[tuple[int, bytes]]: ...
    def replica_summary(self) -> dict[int, tuple[int, int]]: ...
    def holds(self) -> Iterator[Hold]: ...
    def reserve(self, keys: int) -> None:
        """Grow the table for ``keys`` more keys at once (snapshot loads); never shrinks."""
    def dump_columns(
        self,
    ) -> tuple[bytes, bytes, bytes, bytes, bytes, list[tuple[bytes, int, int, int, int]]]:
        """Every hold: 8-byte keys as native-order columns (keys, replicas u32, tokens i32,
        last_seen i64, tiers i32), holds of other key lengths as tuples."""
    def memory_bytes(self) -> int:
        """Bytes this map allocated: table, overflow arena, side table and its key objects."""
    def capacity(self) -> int:
        """Slots in the open-addressing table (a power of two)."""
    def check_invariants(self) -> None:
        """Raise AssertionError if an internal invariant is broken (for tests)."""
    def _tune_candidates(self, min: int, factor: int) -> None:
        """Tests: keep max(factor * k, min) eviction candidates between cap_candidates calls."""

@final
class Applier:
    """Applies ICB1 batches (``index/batch.py``) to BlockMap partitions; ``resolve(kind,
    route)`` returns ``(value, generation)`` as ``batch.resolver`` documents."""

    def __init__(self, resolve: Any) -> None: ...
    def apply(
        self,
        batch: bytes,
        offset: int,
        now_us: int,
        generation: int,
        max_entries: int,
        max_hash_bytes: int,
        stop_after_store: bool,
        /,
    ) -> tuple[list[tuple[Any, int, int, int]], int, bool]: ...
