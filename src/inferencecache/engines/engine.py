"""A fake engine: a prefix cache that publishes its KV events and exposes vLLM's metrics.

:class:`FakeEngine` turns requests (token ids, optional adapter) into what vLLM would publish:
removals of the blocks evicted to make room, then one BlockStored of the newly cached full
blocks chained to the last reused one, all in one batch per step. Workloads drive it.
"""

from __future__ import annotations

import logging

from inferencecache.engines.cache import BlockCache, Inserted
from inferencecache.engines.metrics import EngineMetrics
from inferencecache.engines.publisher import EventPublisher

log = logging.getLogger("inferencecache.engines")


def _adapter(lora_id: int | None, lora_name: str | None) -> str:
    """The cache's adapter key: the name, else ``id:<lora_id>``, else the base model ``""``."""
    return lora_name or (f"id:{lora_id}" if lora_id is not None else "")


class FakeEngine:
    """Publisher + block cache + metrics of one engine replica."""

    def __init__(
        self, publisher: EventPublisher, cache: BlockCache, metrics: EngineMetrics
    ) -> None:
        self.publisher = publisher
        self.cache = cache
        self.metrics = metrics
        self._queried = 0  # prefix-cache tokens of this step, counted at end_step
        self._hits = 0

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def serve(self, tokens: list[int], *, lora_id: int | None = None,
              lora_name: str | None = None, medium: str = "GPU") -> Inserted:
        """One request: queue its evictions and its store into the current step."""
        result = self.cache.insert(tokens, _adapter(lora_id, lora_name))
        self._queried += len(tokens) // self.block_size * self.block_size
        self._hits += result.hit_blocks * self.block_size
        self.publisher.publish_inserted(
            result, self.block_size, lora_id=lora_id, lora_name=lora_name, medium=medium
        )
        return result

    def evict(self, tokens: list[int], *, lora_id: int | None = None,
              lora_name: str | None = None, medium: str = "GPU") -> int:
        """Evict a prompt's cached blocks (one BlockRemoved per block); returns how many."""
        removed = self.cache.remove(tokens, _adapter(lora_id, lora_name))
        for h in removed:
            self.publisher.remove([h], medium=medium)
        return len(removed)

    def reset_prefix_cache(self) -> None:
        """``/reset_prefix_cache``: forget every block and publish AllBlocksCleared."""
        self.cache.clear()
        self.publisher.clear()

    def _account(self) -> None:
        m = self.metrics
        m.kv_cache_usage.set(self.cache.usage())
        if self._queried:
            m.prefix_cache_queries.inc(self._queried)
            m.prefix_cache_hits.inc(self._hits)
            self._queried = self._hits = 0

    def end_step(self, ts: float | None = None, *, live: bool = True) -> int | None:
        """Publish the step's events as one batch; refresh the metrics."""
        self._account()
        return self.publisher.end_step(ts, live=live)

    def encode_step(self, ts: float | None = None) -> bytes | None:
        """The step's batch payload, not published yet (see ``EventPublisher.encode_step``)."""
        self._account()
        return self.publisher.encode_step(ts)
