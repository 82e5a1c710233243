"""An engine-side prefix cache of full blocks, enough to publish realistic KV events.

Engine block hashes chain like vLLM's (each names its whole prefix and its adapter), and are
stable across processes like vLLM ≥ 0.29's default, so a restarted engine publishes the same
hashes for the same content. They are the content chain XOR a per-adapter salt: cheap (one C
call per prompt), adapter-specific, and never equal to the routing fingerprint, so a consumer
that forwarded engine hashes instead of fingerprinting tokens could not pass a test by luck.
Eviction is LRU over blocks, one ``BlockRemoved`` hash per block as vLLM's block pool does.
Reused by the fake engine and meant for the simulated engine.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from inferencecache.fingerprint import prefix_hashes


@functools.cache
def adapter_salt(adapter: str) -> int:
    """The 64-bit salt that separates one adapter's engine hashes (never 0)."""
    digest = hashlib.blake2b(b"fake-engine-block:" + adapter.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") | 1


def engine_hashes(tokens: list[int], block_size: int, adapter: str = "") -> list[int]:
    """Stable 64-bit engine block hashes (unsigned) of every full block, opaque to consumers."""
    salt = adapter_salt(adapter)
    return [h ^ salt for h in prefix_hashes(tokens, block_size)]


@dataclass(slots=True)
class Inserted:
    """What serving one prompt did to the cache."""

    hit_blocks: int  # leading blocks already cached
    stored: list[int] = field(default_factory=list)  # engine hashes newly cached, in order
    parent: int | None = None  # the block before stored[0]
    stored_tokens: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)  # engine hashes evicted to make room


class BlockCache:
    """Full blocks keyed by engine hash, least recently used first."""

    def __init__(self, block_size: int, capacity: int = 0) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.capacity = capacity  # 0 = unbounded
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: int) -> bool:
        return h in self._lru

    def usage(self) -> float:
        """Fraction of the capacity in use (0 when unbounded)."""
        return len(self._lru) / self.capacity if self.capacity else 0.0

    def chain(self, tokens: list[int], adapter: str = "") -> list[int]:
        """Engine hashes of every full block of ``tokens``."""
        return engine_hashes(tokens, self.block_size, adapter)

    def insert(self, tokens: list[int], adapter: str = "") -> Inserted:
        """Serve a prompt: reuse its cached leading blocks, cache the rest, evict to fit."""
        hashes = self.chain(tokens, adapter)
        lru = self._lru
        hit = 0
        for h in hashes:
            if h not in lru:
                break
            lru.move_to_end(h)
            hit += 1
        result = Inserted(hit)
        if hit == len(hashes):
            return result
        new = hashes[hit:]
        if self.capacity:
            keep = set(hashes)
            overflow = len(lru) + sum(1 for h in new if h not in lru) - self.capacity
            for victim in list(lru):
                if overflow <= 0:
                    break
                if victim not in keep:
                    del lru[victim]
                    result.evicted.append(victim)
                    overflow -= 1
        for h in new:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        bs = self.block_size
        result.stored = new
        result.parent = hashes[hit - 1] if hit else None
        result.stored_tokens = tokens[hit * bs : len(hashes) * bs]
        return result

    def remove(self, tokens: list[int], adapter: str = "") -> list[int]:
        """Evict every cached block of a prompt, last block first; returns their hashes."""
        out: list[int] = []
        for h in reversed(self.chain(tokens, adapter)):
            if h in self._lru:
                del self._lru[h]
                out.append(h)
        return out

    def evict(self, n: int) -> list[int]:
        """Evict the ``n`` least recently used blocks."""
        out: list[int] = []
        while self._lru and len(out) < n:
            h, _ = self._lru.popitem(last=False)
            out.append(h)
        return out

    def clear(self) -> None:
        """Reset the prefix cache."""
        self._lru.clear()
