"""The simulated engine's model: LRU prefix cache and the slots + FIFO prefill queue."""

from __future__ import annotations

import pytest

from inferencecache.engines.simulated import EngineModel, EngineParams, SimCache
from inferencecache.fingerprint import prefix_hashes

B = 4


def toks(seed: int, blocks: int, extra: int = 0) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * B + extra)]


def test_engine_hashes_chain_per_adapter_and_differ_from_the_fingerprint() -> None:
    c = SimCache(B, 0)
    t = toks(1, 3)
    base, lora = c.chain(t), c.chain(t, "sql-lora")
    assert len(base) == len(lora) == 3
    assert set(base).isdisjoint(lora)
    assert set(base).isdisjoint(prefix_hashes(t, B))  # opaque, never the routing key
    assert c.chain(t[: 2 * B]) == base[:2]  # block i names the whole prefix 0..i
    assert SimCache(B, 0).chain(t) == base  # stable across instances (and processes)


def test_hits_are_leading_blocks_capped_below_the_last_token() -> None:
    c = SimCache(B, 0)
    first = c.insert(toks(1, 3))
    assert first.hit_blocks == 0 and len(first.stored) == 3 and first.parent is None
    assert first.stored_tokens == toks(1, 3)
    again = c.insert(toks(1, 3))
    assert again.hit_blocks == 3 and again.stored == []
    assert SimCache.hit_cap(3 * B, B) == 2  # vLLM recomputes the last prompt token
    assert SimCache.hit_cap(3 * B + 1, B) == 3
    longer = c.insert(toks(1, 5))
    assert longer.hit_blocks == 3 and len(longer.stored) == 2
    assert longer.parent == c.chain(toks(1, 3))[-1]
    assert longer.stored_tokens == toks(1, 5)[3 * B :]
    assert c.cached_tokens(toks(1, 5, extra=1)) == 5 * B
    assert c.cached_tokens(toks(1, 5)) == 4 * B


def test_adapters_never_share_blocks() -> None:
    c = SimCache(B, 0)
    c.insert(toks(1, 3), "a")
    assert c.match(c.chain(toks(1, 3), "a")) == 3
    assert c.match(c.chain(toks(1, 3), "b")) == 0
    assert c.match(c.chain(toks(1, 3))) == 0


def test_lru_evicts_chain_tails_first_and_never_the_prompt_being_served() -> None:
    c = SimCache(B, 6)
    a = c.chain(toks(1, 3))
    c.insert(toks(1, 3))
    c.insert(toks(2, 3))
    assert len(c) == 6
    r = c.insert(toks(3, 2))
    # prompt 1 is the least recently used; its tail goes first, its root survives longest
    assert r.evicted == [a[2], a[1]]
    assert len(c) == 6
    assert c.match(a) == 1
    big = c.insert(toks(4, 6))
    assert len(big.stored) == 6 and len(c) == 6
    assert not set(big.evicted) & set(c.chain(toks(4, 6)))


def test_match_does_not_touch_lru_order() -> None:
    c = SimCache(B, 4)
    a, b = c.chain(toks(1, 2)), c.chain(toks(2, 2))
    c.insert(toks(1, 2))
    c.insert(toks(2, 2))
    assert c.match(a) == 2  # a read: prompt 1 stays least recently used
    r = c.insert(toks(3, 2))
    assert set(r.evicted) == set(a)
    assert c.match(b) == 2


def test_queueing_fifo_prefill_and_slots() -> None:
    p = EngineParams(block_size=B, num_blocks=0, max_num_seqs=1, prefill_ms_per_token=1.0,
                     decode_ms_per_token=10.0, prefill_base_ms=0.0)
    m: EngineModel[str] = EngineModel(p)
    m.submit("a", toks(1, 2), "", 3, 0.0)
    m.submit("b", toks(1, 2), "", 1, 0.0)
    assert m.load() == 2
    (a,) = m.schedule(0.0)
    assert a.key == "a" and a.hit_tokens == 0
    assert a.first_token_at == pytest.approx(0.008)  # 8 uncached tokens x 1 ms
    assert a.finish_at == pytest.approx(0.028)  # + 2 more tokens x 10 ms
    assert m.schedule(0.01) == []  # the only slot is busy: b waits
    assert m.running == 1 and m.num_waiting == 1
    m.finish()
    (b,) = m.schedule(a.finish_at)
    assert b.hit_tokens == 4  # 2 blocks cached, capped at (8 - 1) // 4 = 1 block
    assert b.first_token_at == pytest.approx(a.finish_at + 0.004)
    assert m.counters.queries == 16 and m.counters.hits == 4 and m.counters.requests == 2


def test_concurrent_prefills_share_one_lane() -> None:
    p = EngineParams(block_size=B, num_blocks=0, max_num_seqs=4, prefill_ms_per_token=1.0,
                     decode_ms_per_token=0.0, prefill_base_ms=0.0)
    m: EngineModel[int] = EngineModel(p)
    for i in range(3):
        m.submit(i, toks(10 + i, 2), "", 1, 0.0)
    firsts = [a.first_token_at for a in m.schedule(0.0)]
    assert firsts == pytest.approx([0.008, 0.016, 0.024])


def test_prompts_larger_than_the_cache_are_refused() -> None:
    m: EngineModel[int] = EngineModel(EngineParams(block_size=B, num_blocks=2))
    with pytest.raises(ValueError, match="blocks"):
        m.submit(1, toks(1, 3), "", 1, 0.0)
    with pytest.raises(ValueError, match="empty"):
        m.submit(1, [], "", 1, 0.0)


def test_cancel_and_reset() -> None:
    m: EngineModel[str] = EngineModel(EngineParams(block_size=B, num_blocks=0, max_num_seqs=1))
    m.submit("a", toks(1, 2), "", 1, 0.0)
    m.submit("b", toks(2, 2), "", 1, 0.0)
    m.schedule(0.0)
    assert m.cancel("b") and not m.cancel("b")
    assert len(m.cache) == 2
    m.reset_cache()
    assert len(m.cache) == 0
