"""The engine-side block cache: stable engine hashes, chained stores, LRU eviction."""

from __future__ import annotations

from inferencecache.engines.cache import BlockCache, adapter_salt
from inferencecache.fingerprint import prefix_hashes


def test_hashes_are_stable_chained_and_adapter_specific() -> None:
    c = BlockCache(4)
    t = list(range(12))
    a = c.chain(t)
    assert a == BlockCache(4).chain(t)  # same content → same ids in another "process"
    assert a == [h ^ adapter_salt("") for h in prefix_hashes(t, 4)]
    assert not set(a) & set(prefix_hashes(t, 4))  # never the routing fingerprint
    assert c.chain(t[:8]) == a[:2]  # each hash names its whole prefix
    assert c.chain(t, "sql-lora") != a
    assert c.chain(t[:11]) == a[:2]  # a partial block has no hash


def test_insert_reuses_the_cached_prefix_and_stores_the_rest() -> None:
    c = BlockCache(4)
    first = c.insert(list(range(8)))
    assert first.hit_blocks == 0 and first.parent is None and len(first.stored) == 2
    assert first.stored_tokens == list(range(8))
    second = c.insert(list(range(12)))
    assert second.hit_blocks == 2 and second.parent == first.stored[-1]
    assert second.stored_tokens == list(range(8, 12))
    again = c.insert(list(range(12)))
    assert again.stored == [] and again.hit_blocks == 3


def test_lru_eviction_spares_the_prompt_being_served() -> None:
    c = BlockCache(4, capacity=3)
    a = c.insert(list(range(8)))  # 2 blocks
    c.insert(list(range(100, 104)))  # 1 block → full
    c.insert(list(range(8)))  # touch a
    b = c.insert(list(range(200, 208)))  # needs 2 → evicts the LRU ones
    assert len(c) == 3
    assert set(b.evicted) == {c.chain(list(range(100, 104)))[0], a.stored[0]}
    assert c.usage() == 1.0


def test_remove_and_clear() -> None:
    c = BlockCache(4)
    hashes = c.insert(list(range(12))).stored
    assert c.remove(list(range(12))) == list(reversed(hashes))
    assert len(c) == 0 and c.remove(list(range(12))) == []
    c.insert(list(range(4)))
    c.clear()
    assert len(c) == 0 and c.evict(3) == []
