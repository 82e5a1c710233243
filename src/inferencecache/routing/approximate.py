"""A history-only prefix router: remembers where it sent each prefix, never sees engine events.

It models routers such as SGLang's approximate radix-tree router or llm-d's prefix-cache scorer
without events: the router's own past decisions stand in for the engines' caches. Because block
``i`` of the fingerprint chain names the whole prefix ``0..i``, a set of chain hashes per
replica *is* a prefix tree: the longest remembered prefix is the number of leading chain hashes
the replica holds.

Memory is bounded per replica (``capacity_blocks``, LRU) to mimic a finite engine cache. A
request's blocks are touched root-last, so the root is the most recently used and the deepest
blocks of cold prompts go first, as in vLLM's free-block queue (a tail evicted before its
parent keeps the walk sound). What it cannot know: evictions caused by other traffic, engine
restarts, cache resets, and load-dependent preemption; that is the gap the hint plane closes.

Decision, per request:

1. Walk the chain over the healthy replicas; the survivors at the deepest block are the
   candidates, if that depth is at least ``min_match_blocks`` and covers at least
   ``match_threshold`` of the prompt's blocks (reason ``APPROX_PREFIX``).
2. Otherwise every healthy replica is a candidate (``APPROX_NEW``), preferring the one that
   remembers the fewest blocks (the emptiest cache), like SGLang's fallback.
3. Load guard (only when the caller passes ``RouteInput.load`` and ``balance_abs_threshold > 0``):
   if ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min`` over the
   healthy replicas' in-flight counts, the least loaded replicas win (``APPROX_BALANCE``).
4. Ties: fewest in flight, then (for new prefixes) fewest remembered blocks, then the replica
   chosen least recently.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence

from inferencecache.fingerprint import HASH_BYTES
from inferencecache.routing import reasons
from inferencecache.routing.basic import check_balance, least_loaded
from inferencecache.routing.model import Decision, RouteInput


class ApproximatePolicy:
    """Longest prefix among this router's own past decisions, bounded by an LRU per replica."""

    name = "approximate"
    needs_hint = False
    needs_oracle = False

    def __init__(
        self,
        capacity_blocks: int = 8192,
        min_match_blocks: int = 1,
        match_threshold: float = 0.0,
        balance_abs_threshold: int = 0,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if min_match_blocks < 1:
            raise ValueError(f"min_match_blocks must be >= 1, got {min_match_blocks}")
        if not 0.0 <= match_threshold <= 1.0:
            raise ValueError(f"match_threshold must be in [0, 1], got {match_threshold}")
        check_balance(balance_abs_threshold, balance_rel_threshold)
        self.capacity_blocks = capacity_blocks
        self.min_match_blocks = min_match_blocks
        self.match_threshold = match_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._partitions: dict[tuple[str, str], int] = {}  # (model, adapter) -> small int
        self._bits: dict[str, int] = {}  # replica -> its bit in an owner mask
        self._owners: dict[int, int] = {}  # (partition << 64 | hash) -> replica bitmask
        self._lru: dict[str, OrderedDict[int, None]] = {}  # replica -> keys, oldest first
        self._last_chosen: dict[str, int] = {}
        self._seq = 0
        self._keys_for: RouteInput | None = None  # one-entry cache: choose then observe
        self._chain_for: bytes = b""
        self._part_for: tuple[str, str] = ("", "")
        self._keys: list[int] = []

    # -- introspection (tests, simulator reports) ------------------------------------------------

    def remembered_blocks(self, replica: str) -> int:
        """How many blocks this router believes ``replica`` holds (<= capacity_blocks)."""
        lru = self._lru.get(replica)
        return len(lru) if lru is not None else 0

    def matched_blocks(self, route: RouteInput, replica: str) -> int:
        """Leading blocks of ``route`` this router believes ``replica`` holds."""
        bit = self._bits.get(replica, 0)
        n = 0
        for key in self._route_keys(route):
            if not self._owners.get(key, 0) & bit:
                break
            n += 1
        return n

    @property
    def tracked_keys(self) -> int:
        """Distinct (partition, block) keys remembered over all replicas."""
        return len(self._owners)

    # -- policy ----------------------------------------------------------------------------------

    def choose(self, route: RouteInput, healthy: Sequence[str]) -> Decision:
        keys = self._route_keys(route)
        alive = 0
        for r in healthy:
            alive |= self._bits.get(r, 0)
        depth = 0
        owners = self._owners
        for key in keys:
            mask = owners.get(key, 0) & alive
            if not mask:
                break
            alive = mask
            depth += 1
        prefix = (
            depth > 0
            and depth >= self.min_match_blocks
            and depth >= self.match_threshold * len(keys)
        )
        if prefix:
            candidates = [r for r in healthy if self._bits.get(r, 0) & alive]
            reason = reasons.APPROX_PREFIX
        else:
            candidates = list(healthy)
            reason = reasons.APPROX_NEW
        load = route.load
        if load and self.balance_abs_threshold > 0 and len(healthy) > 1:
            loads = [load.get(r, 0) for r in healthy]
            high, low = max(loads), min(loads)
            if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
                balanced = least_loaded(healthy, load)
                keep = [r for r in candidates if r in balanced]
                if keep:
                    candidates = keep
                else:
                    candidates = balanced
                    reason = reasons.APPROX_BALANCE
        candidates = least_loaded(candidates, load)
        last = self._last_chosen
        if reason == reasons.APPROX_PREFIX:
            replica = min(candidates, key=lambda r: last.get(r, -1))
        else:
            replica = min(candidates, key=lambda r: (self.remembered_blocks(r), last.get(r, -1)))
        return Decision(replica, reason)

    def observe(self, route: RouteInput, replica: str) -> None:
        """Remember that ``replica`` now holds the request's blocks (evicting its LRU tail)."""
        self._seq += 1
        self._last_chosen[replica] = self._seq
        bit = self._bits.get(replica)
        if bit is None:
            bit = self._bits[replica] = 1 << len(self._bits)
            self._lru[replica] = OrderedDict()
        lru = self._lru[replica]
        owners = self._owners
        for key in reversed(self._route_keys(route)):  # root last = most recently used
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                owners[key] = owners.get(key, 0) | bit
        while len(lru) > self.capacity_blocks:
            old, _ = lru.popitem(last=False)
            mask = owners.get(old, 0) & ~bit
            if mask:
                owners[old] = mask
            else:
                owners.pop(old, None)

    def _route_keys(self, route: RouteInput) -> list[int]:
        """The request's block keys: (model, adapter) partition in the high bits, hash below."""
        cached = self._keys_for
        if (
            route is cached
            and route.chain is self._chain_for
            and (route.model_id, route.adapter_id) == self._part_for
        ):
            return self._keys
        part_key = (route.model_id, route.adapter_id)
        part = self._partitions.get(part_key)
        if part is None:
            part = self._partitions[part_key] = len(self._partitions)
        n = len(route.chain) // HASH_BYTES
        base = part << 64
        keys = [base | h for h in struct.unpack_from(f">{n}Q", route.chain)] if n else []
        self._keys_for, self._chain_for, self._part_for = route, route.chain, part_key
        self._keys = keys
        return keys
