"""Timeouts, echo rules, LFU credit, hint_used: contract-and-index.md §10 items 70-75."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from inferencecache.index import PROBE_TENANT, FakeClock, Reason, Stats
from inferencecache.index.store import PartitionOps, PartitionStore, Run
from tests.index.support import Env, FakeTokenizer, h, ids


class SlowStore:
    """Delegates to a real store; every read the lookup does advances the fake clock."""

    def __init__(self, inner: PartitionStore, clock: FakeClock, delay: list[float]) -> None:
        self._inner = inner
        self._clock = clock
        self._delay = delay

    def walk(self, keys: Any, counts: Any, fresh_after: int) -> list[Run]:
        self._clock.advance(self._delay[0])
        return self._inner.walk(keys, counts, fresh_after)

    def walk_ranked(self, keys: Any, counts: Any, fresh_after: int, ranker: Any) -> Any:
        self._clock.advance(self._delay[0])
        return PartitionOps(self._inner).walk_ranked(keys, counts, fresh_after, ranker)

    def holders(self, key: bytes, fresh_after: int) -> list[tuple[int, int, int, int]]:
        self._clock.advance(self._delay[0])
        return self._inner.holders(key, fresh_after)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _slow_env(
    make_env: Callable[..., Env], store_factory: Callable[[], PartitionStore]
) -> tuple[Env, list[float]]:
    clock = FakeClock()
    delay = [0.0]
    env = make_env(clock=clock)
    env.index.store_factory = lambda: SlowStore(store_factory(), clock, delay)  # type: ignore[assignment]
    env.index._state.store_factory = env.index.store_factory
    return env, delay


def test_c10_70_passed_caller_deadline(env: Env) -> None:
    env.chain("r1", [h(1)])
    for late in (0.0, 0.5):
        res = env.lookup([h(1)], adapter_id="a", deadline=env.clock.monotonic() - late)
        assert (res.reason_code, res.replica_scores, res.adapter_id) == (Reason.TIMEOUT, [], "")
    res = env.lookup([h(1)], deadline=env.clock.monotonic() + 1)
    assert res.reason_code == Reason.PREFIX_MATCH


def test_c10_71_slow_index_run_times_out_without_credit(
    make_env: Callable[..., Env], store_factory: Callable[[], PartitionStore]
) -> None:
    env, delay = _slow_env(make_env, store_factory)
    env.policy(eviction="lfu", lookup_timeout_ms=50)
    env.chain("r1", [h(1), h(2)])
    delay[0] = 0.060
    res = env.lookup([h(1), h(2)])
    assert (res.reason_code, res.replica_scores, res.adapter_id) == (Reason.TIMEOUT, [], "")
    assert env.access("r1", h(1)) == 0
    delay[0] = 0.040
    assert env.lookup([h(1), h(2)]).reason_code == Reason.PREFIX_MATCH
    assert env.access("r1", h(1)) == 1
    env.policy(eviction="lfu", lookup_timeout_ms=0)
    delay[0] = 100.0
    assert env.lookup([h(1), h(2)]).reason_code == Reason.PREFIX_MATCH
    env.policy(eviction="lfu", lookup_timeout_ms=-5)
    assert env.exact(h(1)).reason_code == Reason.PREFIX_MATCH
    # a caller deadline that passes while the index runs is a TIMEOUT as well
    res = env.lookup([h(1)], deadline=env.clock.monotonic() + 1.0)
    assert res.reason_code == Reason.TIMEOUT


def test_c10_72_hung_tokenizer_times_out_after_5s(make_env: Callable[..., Env]) -> None:
    release = threading.Event()
    tok = FakeTokenizer()
    env = make_env(tokenizer=tok)
    env.chain("r1", [h(1)])

    def hung(text: str) -> list[int]:
        env.clock.advance(5.01)
        release.wait(30)
        return [1] * 16

    def slow(text: str) -> list[int]:
        env.clock.advance(4.9)
        return [ord(c) for c in text]

    try:
        tok.fn = hung
        res = env.lookup(prompt_text="x" * 16, adapter_id="a")
        assert (res.reason_code, list(res.token_ids), res.adapter_id) == (Reason.TIMEOUT, [], "")
        tok.fn = slow
        res = env.lookup(prompt_text="x" * 16)
        assert res.reason_code == Reason.NO_HINT and len(res.token_ids) == 16
    finally:
        release.set()
    # the 5 s default applies only when prompt_text is the effective input
    tok.fn = hung
    release.clear()
    try:
        res = env.lookup([h(1)], prompt_text="x" * 16)
        assert res.reason_code == Reason.PREFIX_MATCH and tok.calls[-1:] != []
        assert len(tok.calls) == 2  # the chain won: the tokenizer was not called again
    finally:
        release.set()


def test_c10_73_adapter_echo(make_env: Callable[..., Env]) -> None:
    env = make_env(tokenizer=FakeTokenizer())
    env.chain("r1", [h(1)], entry_adapter="a")
    env.legacy("r2", h(5), 64)
    env.stats("r2", hit_rate=0.9)

    def echo(**kw: Any) -> tuple[str, str]:
        res = env.lookup(adapter_id=kw.pop("adapter_id", "a"), **kw)
        return res.reason_code, res.adapter_id

    assert echo(block_hashes=[h(1)], block_token_counts=[16]) == (Reason.PREFIX_MATCH, "a")
    assert echo(prefix_hash=h(9)) == (Reason.TENANT_HOT, "a")
    assert echo(tenant_id="x", prefix_hash=h(9)) == (Reason.UNKNOWN_TENANT, "a")
    assert echo(model_id="x", prefix_hash=h(9)) == (Reason.UNKNOWN_MODEL, "a")
    assert echo(hash_scheme="x", prefix_hash=h(9)) == (Reason.UNKNOWN_HASH_SCHEME, "a")
    assert echo(block_hashes=[h(9)], block_token_counts=[16]) == (Reason.NO_HINT, "a")
    assert echo(hash_scheme="", prefix_hash=h(9)) == (Reason.NO_HINT, "a")
    env.policy(affinity_routing=True)
    assert echo(block_hashes=[h(9)], block_token_counts=[16]) == (Reason.AFFINITY_HINT, "a")
    # pre-index envelopes
    assert echo(tenant_id=PROBE_TENANT, prefix_hash=h(9)) == (Reason.NO_HINT, "")
    assert echo(prefix_hash=h(9), deadline=env.clock.monotonic()) == (Reason.TIMEOUT, "")
    assert echo(block_hashes=[h(9)], block_token_counts=[]) == (Reason.NO_HINT, "")
    assert echo(token_ids=[1, 2]) == (Reason.NO_HINT, "")
    assert echo(prompt_text="x") == (Reason.NO_HINT, "")
    env.policy(affinity_routing=False, minimum_prefix_tokens=100)
    assert echo(block_hashes=[h(1)], block_token_counts=[16]) == (Reason.NO_HINT, "")
    env.policy(require_chain=True)
    assert echo(prefix_hash=h(9)) == (Reason.POLICY_REQUIRES_CHAIN, "")


def test_c10_74_lfu_credit(env: Env) -> None:
    env.policy(eviction="lfu")
    env.chain("r1", [h(1), h(2), h(3)])
    env.chain("r2", [h(1)])
    env.legacy("r3", h(50), 64)
    env.legacy("r3", h(51), 0)
    assert ids(env.lookup([h(1), h(2), h(3), h(4)])) == ["r1", "r2"]
    assert [env.access("r1", k) for k in (h(1), h(2), h(3))] == [1, 1, 1]
    assert env.access("r2", h(1)) == 1
    # exact: the hold if its token_count > 0
    env.exact(h(50))
    env.exact(h(51))
    assert (env.access("r3", h(50)), env.access("r3", h(51))) == (1, 0)
    # G1-filtered replicas get nothing, the delivered one does
    env.policy(eviction="lfu", minimum_matched_tokens=32)
    assert ids(env.lookup([h(1), h(2), h(3)])) == ["r1"]
    assert env.access("r1", h(1)) == 2 and env.access("r2", h(1)) == 1
    # downgrades credit nothing
    env.policy(eviction="lfu", routing_floor_score=1e9)
    assert env.lookup([h(1), h(2), h(3)]).reason_code == Reason.NO_HINT
    env.policy(eviction="lfu", minimum_prefix_tokens=64, affinity_routing=True)
    assert env.lookup([h(1), h(2), h(3)]).reason_code == Reason.AFFINITY_HINT
    assert env.access("r1", h(1)) == 2
    # LRU tenants are never credited
    env.policy(eviction="lru")
    env.lookup([h(1), h(2), h(3)])
    assert env.access("r1", h(1)) == 2
    # TENANT_HOT credits nothing
    env.policy(eviction="LFU")
    env.stats("r1", hit_rate=0.9)
    assert env.exact(h(77)).reason_code == Reason.TENANT_HOT
    assert sum(v[3] for v in env.holds().values()) == 3 * 2 + 1 + 1  # r1 x3, r2, r3
    env.lookup([h(1)])
    assert env.access("r1", h(1)) == 3  # case-insensitive "LFU"


def test_c10_75_scores_present_iff_hint_used(make_env: Callable[..., Env]) -> None:
    env = make_env(tokenizer=FakeTokenizer())
    env.chain("r1", [h(1)])
    env.stats("r1", hit_rate=0.9)
    env.update("r1", [], tenant_id="u", stats=Stats())
    seen: set[str] = set()
    for affinity in (False, True):
        env.policy(affinity_routing=affinity)
        for kw in (
            {"block_hashes": [h(1)], "block_token_counts": [16]},
            {"block_hashes": [h(2)], "block_token_counts": [16]},
            {"prefix_hash": h(2)},
            {"prefix_hash": h(2), "tenant_id": "x"},
            {"prefix_hash": h(2), "tenant_id": PROBE_TENANT},
            {"prefix_hash": h(2), "deadline": 0.0},
            {"token_ids": [1]},
            {"prefix_hash": h(2), "hash_scheme": ""},
        ):
            res = env.lookup(**kw)  # type: ignore[arg-type]
            seen.add(res.reason_code)
            hint = res.reason_code in (
                Reason.PREFIX_MATCH,
                Reason.TENANT_HOT,
                Reason.AFFINITY_HINT,
            )
            assert bool(res.replica_scores) == hint, (kw, res)
    assert {Reason.PREFIX_MATCH, Reason.TENANT_HOT, Reason.AFFINITY_HINT, Reason.NO_HINT} <= seen
