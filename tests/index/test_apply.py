"""Ingest and events: contract-and-index.md §10 items 5-25 (index side), tiers, adapters, stats
rows."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from inferencecache.index import PROBE_TENANT, EventType, Prefix, Reason, Stats, Tier
from tests.index.support import MIN, TTL, Env, h, ids


def test_c10_05_empty_update_changes_nothing(env: Env) -> None:
    """Index side of item 5: a message with no prefixes and no stats applies nothing (the
    server acks an empty stream without calling the index at all)."""
    env.update("r1")
    assert env.index.counts()["holds"] == 0
    assert env.index.cache_state("t", "m").replicas == []
    assert env.index.snapshot()["replicas"] == []


def test_c10_06_update_visible_to_the_next_lookup(env: Env) -> None:
    """Index side of item 6: each update is applied on receipt, so the next lookup sees it."""
    env.legacy("r1", h(1), 64)
    res = env.exact(h(1))
    assert res.reason_code == Reason.PREFIX_MATCH and ids(res) == ["r1"]
    env.legacy("r2", h(2), 64)
    assert ids(env.exact(h(2))) == ["r2"]


def test_c10_07_earlier_updates_remain_after_a_failed_one(env: Env) -> None:
    """Index side of item 7: a later update that fails (here: not even well-typed) rolls
    nothing back and corrupts no view."""
    env.legacy("r1", h(1), 64)
    with pytest.raises(TypeError):
        env.update("r1", [Prefix(prefix_hash=None, token_count=1)])  # type: ignore[arg-type]
    assert ids(env.exact(h(1))) == ["r1"]
    env.check()


def test_c10_08_legacy_exact_lookup(env: Env) -> None:
    env.legacy("r1", h(1), 128)
    res = env.exact(h(1), 128)
    assert res.reason_code == Reason.PREFIX_MATCH
    assert res.replica_scores[0].matched_tokens == 128


def test_c10_09_chain_makes_one_key_per_block(env: Env) -> None:
    env.chain("r1", [h(1), h(2), h(3)], [16, 16, 16])
    assert env.index.counts()["keys"] == 3
    res = env.exact(h(2))
    assert res.reason_code == Reason.PREFIX_MATCH
    assert res.replica_scores[0].matched_tokens == 32


def test_c10_10_chain_plus_prefix_hash_makes_n_plus_1_keys(env: Env) -> None:
    env.chain("r1", [h(1), h(2), h(3)], 16, prefix_hash=h(99), token_count=777)
    assert env.index.counts()["keys"] == 4
    res = env.exact(h(99))
    assert res.replica_scores[0].matched_tokens == 777
    assert env.exact(h(3)).replica_scores[0].matched_tokens == 48


def test_c10_11_unequal_chain_arrays_index_nothing(env: Env) -> None:
    env.update(
        "r1",
        [
            Prefix(block_hashes=[h(1), h(2), h(3)], block_token_counts=[16]),
            Prefix(block_hashes=[h(4)]),
            Prefix(block_token_counts=[16, 16], prefix_hash=h(5), token_count=32),
        ],
    )
    assert env.index.counts()["keys"] == 0
    assert env.metrics.dropped["chain_length_mismatch"] == 3
    # no fallback to prefix_hash for a malformed chain entry
    assert env.exact(h(5)).reason_code != Reason.PREFIX_MATCH


def test_c10_12_empty_hash_scheme_stores_stats_only(env: Env) -> None:
    env.update(
        "r1",
        [
            Prefix(prefix_hash=h(1), token_count=64),
            Prefix(block_hashes=[h(2)], block_token_counts=[16]),
        ],
        hash_scheme="",
        stats=Stats(hit_rate=0.5, cache_memory_bytes=7),
    )
    assert env.index.counts()["keys"] == 0
    rows = env.index.cache_state("t", "m").replicas
    assert [(r.replica_id, r.hit_rate, r.cache_memory_bytes) for r in rows] == [("r1", 0.5, 7)]
    assert env.metrics.dropped["empty_hash_scheme"] == 2


def test_c10_13_reingest_keeps_counts_and_access(env: Env) -> None:
    env.policy(eviction="lfu")
    env.chain("r1", [h(1), h(2)], 32)
    before = env.index.counts()
    assert env.lookup([h(1), h(2)], 32).reason_code == Reason.PREFIX_MATCH
    assert env.access("r1", h(1)) == 1
    env.clock.advance(10)
    env.chain("r1", [h(1), h(2)], 32, tier=2)
    assert env.index.counts() == before
    assert env.access("r1", h(1)) == 1 and env.access("r1", h(2)) == 1
    hold = env.holds()[("t", "m", "vllm", "", h(1), "r1")]
    assert hold[1] == env.now and hold[2] == 2  # last_seen and tier overwritten


def test_c10_14_update_is_a_delta_not_a_snapshot(env: Env) -> None:
    env.update(
        "r1", [Prefix(prefix_hash=h(1), token_count=64), Prefix(prefix_hash=h(2), token_count=64)]
    )
    env.update("r1", [Prefix(prefix_hash=h(2), token_count=64)])
    assert ids(env.exact(h(1))) == ["r1"]


def test_c10_15_zero_timestamp_uses_server_time_and_old_ones_are_stale(env: Env) -> None:
    env.legacy("r1", h(1), 64, timestamp_us=0)
    assert env.holds()[("t", "m", "vllm", "", h(1), "r1")][1] == env.now
    env.legacy("r2", h(2), 64, age=TTL + 1)
    assert env.exact(h(2)).reason_code == Reason.NO_HINT  # stale at once, before any sweep
    # a future timestamp is used verbatim (freshness 1)
    env.legacy("r3", h(3), 64, timestamp_us=env.now + 10_000_000)
    res = env.exact(h(3))
    assert res.replica_scores[0].estimated_cache_hit_prob == 1.0


@dataclass
class _NestedStats:
    replica_id: str = "someone-else"
    cache_memory_bytes: int = 1
    hit_rate: float = math.nan
    pressure: float = math.inf
    t2_hit_tokens: int = 0
    t2_query_tokens: int = 0


def test_c10_16_stats_keyed_by_update_replica_and_nan_inf_zeroed(env: Env) -> None:
    env.update("r1", [], stats=_NestedStats())
    env.update("r2", [], stats=_NestedStats(hit_rate=-math.inf, pressure=math.nan))
    rows = env.index.cache_state("t", "m").replicas
    assert [r.replica_id for r in rows] == ["r1", "r2"]
    assert all(r.hit_rate == 0.0 and r.pressure == 0.0 for r in rows)
    # no other clamping
    env.stats("r3", hit_rate=1.5, pressure=-2.0)
    r3 = env.index.cache_state("t", "m").replicas[2]
    assert (r3.hit_rate, r3.pressure) == (1.5, -2.0)


def test_c10_17_probe_tenant_updates_and_events_change_nothing(env: Env) -> None:
    env.legacy("r1", h(1), 64, tenant_id=PROBE_TENANT, stats=Stats(hit_rate=1))
    env.chain("r1", [h(2)], tenant_id=PROBE_TENANT)
    assert env.index.counts()["holds"] == 0
    env.legacy("r1", h(1), 64)
    env.stats("r1", hit_rate=0.5)
    env.event(EventType.ALL_CLEARED, "r1", tenant_id=PROBE_TENANT)
    env.event(EventType.PREFIX_EVICTED, "r1", h(1), tenant_id=PROBE_TENANT)
    assert env.index.counts()["holds"] == 1
    assert env.index.cache_state(PROBE_TENANT, "m").replicas == []
    assert env.metrics.entries == {"m": 1}


def _tier(env: Env, key: bytes) -> int:
    return env.exact(key).replica_scores[0].tier


def test_c10_18_tier_unset_t2_and_back(env: Env) -> None:
    env.legacy("r1", h(1), 64)
    assert _tier(env, h(1)) == Tier.T1
    env.legacy("r1", h(1), 64, tier=2)
    assert _tier(env, h(1)) == Tier.T2
    env.legacy("r1", h(1), 64, tier=1)
    assert _tier(env, h(1)) == Tier.T1
    env.legacy("r1", h(1), 64, tier=3)
    assert _tier(env, h(1)) == Tier.T3


def test_c10_19_future_and_negative_tiers_read_unspecified(env: Env) -> None:
    env.legacy("r1", h(1), 64, tier=7)
    env.legacy("r1", h(2), 64, tier=-1)
    assert _tier(env, h(1)) == Tier.UNSPECIFIED
    assert _tier(env, h(2)) == Tier.UNSPECIFIED
    env.chain("r2", [h(10), h(11)], tier=1)
    env.chain("r2", [h(12)], tier=7)
    env.chain("r3", [h(10), h(11)], tier=2)
    env.chain("r3", [h(12)], tier=-1)
    res = env.lookup([h(10), h(11), h(12)])
    assert {s.replica_id: s.tier for s in res.replica_scores} == {"r2": 0, "r3": 0}
    # the two-block prefix without the odd tier keeps its colder real tier
    res = env.lookup([h(10), h(11)])
    assert {s.replica_id: s.tier for s in res.replica_scores} == {"r2": 1, "r3": 2}


def test_c10_20_entry_adapter_overrides_update_adapter(env: Env) -> None:
    env.update(
        "r1",
        [
            Prefix(prefix_hash=h(1), token_count=64, adapter_id="sql"),
            Prefix(prefix_hash=h(2), token_count=64),
        ],
        adapter_id="chat",
    )
    assert ids(env.exact(h(1), adapter_id="sql")) == ["r1"]
    assert env.exact(h(1), adapter_id="chat").reason_code != Reason.PREFIX_MATCH
    assert ids(env.exact(h(2), adapter_id="chat")) == ["r1"]
    assert env.exact(h(2)).reason_code != Reason.PREFIX_MATCH  # "" never matches a named one
    # chain blocks and the co-set legacy key share the entry's adapter
    env.chain("r2", [h(3)], prefix_hash=h(4), token_count=16, entry_adapter="x", adapter_id="y")
    assert ids(env.exact(h(3), adapter_id="x")) == ["r2"]
    assert ids(env.exact(h(4), adapter_id="x")) == ["r2"]


def test_c10_21_prefix_added_and_unspecified_are_no_ops(env: Env) -> None:
    env.legacy("r1", h(1), 64, stats=Stats(hit_rate=0.5))
    before = (env.holds(), env.index.snapshot())
    for t in (EventType.PREFIX_ADDED, EventType.TYPE_UNSPECIFIED, 99):
        env.event(t, "r1", h(1))
        env.event(t, "r9", h(7))
    assert (env.holds(), env.index.snapshot()) == before


def test_c10_22_evicted_without_adapter_sweeps_schemes_and_adapters(env: Env) -> None:
    for scheme in ("vllm", "sglang"):
        for adapter in ("", "sql"):
            env.legacy("r1", h(1), 64, hash_scheme=scheme, entry_adapter=adapter)
            env.legacy("r2", h(1), 64, hash_scheme=scheme, entry_adapter=adapter)
    env.legacy("r1", h(1), 64, model_id="other")
    env.legacy("r1", h(2), 64)
    env.event(EventType.PREFIX_EVICTED, "r1", h(1))
    left = {(k[1], k[2], k[3], k[4], k[5]) for k in env.holds()}
    assert left == {("m", s, a, h(1), "r2") for s in ("vllm", "sglang") for a in ("", "sql")} | {
        ("other", "vllm", "", h(1), "r1"),
        ("m", "vllm", "", h(2), "r1"),
    }


def test_c10_23_evicted_with_adapter_is_partition_scoped(env: Env) -> None:
    env.legacy("r1", h(1), 64, entry_adapter="sql")
    env.legacy("r1", h(1), 64, entry_adapter="chat")
    env.legacy("r1", h(1), 64)
    env.event(EventType.PREFIX_EVICTED, "r1", h(1), adapter_id="sql")
    assert {k[3] for k in env.holds()} == {"chat", ""}


def test_c10_24_all_cleared_removes_replica_holds_and_stats_of_the_model(env: Env) -> None:
    env.legacy("r1", h(1), 64, entry_adapter="sql", stats=Stats(hit_rate=0.3))
    env.legacy("r1", h(2), 64, hash_scheme="sglang")
    env.legacy("r2", h(1), 64, entry_adapter="sql")
    env.legacy("r1", h(1), 64, model_id="m2", stats=Stats(hit_rate=0.4))
    env.event(EventType.ALL_CLEARED, "r1", adapter_id="ignored")
    left = {(k[1], k[5]) for k in env.holds()}
    assert left == {("m", "r2"), ("m2", "r1")}
    assert env.index.cache_state("t", "m").replicas == []
    assert [r.replica_id for r in env.index.cache_state("t", "m2").replicas] == ["r1"]


def test_c10_25_replica_updated_is_liveness_only(env: Env) -> None:
    env.legacy("r1", h(1), 64)
    env.legacy("r2", h(2), 64)
    env.stats("r1", hit_rate=0.8, pressure=0.5)
    # without a stats row REPLICA_UPDATED creates nothing
    env.event(EventType.REPLICA_UPDATED, "r2")
    assert [r.replica_id for r in env.index.cache_state("t", "m").replicas] == ["r1"]
    # liveness keeps the row through sweeps past its TTL ...
    for _ in range(3):
        env.clock.advance(20 * MIN)
        env.legacy("r1", h(1), 64)  # keep the holds fresh
        env.legacy("r2", h(2), 64)
        env.event(EventType.REPLICA_UPDATED, "r1")
        env.index.sweep()
    assert [r.replica_id for r in env.index.cache_state("t", "m").replicas] == ["r1"]
    # ... but pressure (stats_reported older than TTL) is not used again: score = 64 * 1
    res = env.exact(h(1))
    assert res.replica_scores[0].score == pytest.approx(64 * 0.5)  # DP 1/2 only, no pressure
    # and TENANT_HOT stays ineligible (stats_reported > 5 min old)
    assert env.exact(h(99)).reason_code == Reason.NO_HINT
    # without liveness refreshes the row expires by TTL
    env.clock.advance(TTL)
    env.legacy("r1", h(1), 64)
    env.index.sweep()
    assert env.index.cache_state("t", "m").replicas == []


def test_protobuf_messages_pass_straight_in(env: Env) -> None:
    """The server hands generated messages to the index without copying (attribute names are
    the protobuf fields); stats presence follows HasField."""
    pb = pytest.importorskip("inferencecache.v1alpha1.inferencecache_pb2")
    msg = pb.CacheStateUpdate(
        replica_id="r1",
        model_id="m",
        tenant_id="t",
        hash_scheme="vllm",
        prefixes=[
            pb.PrefixEntry(block_hashes=[h(1), h(2)], block_token_counts=[16, 16], tier=2),
            pb.PrefixEntry(prefix_hash=h(3), token_count=64, adapter_id="sql"),
        ],
    )
    env.index.apply_update(msg)
    assert env.index.cache_state("t", "m").replicas == []  # stats absent
    assert {(k[3], k[4]) for k in env.holds()} == {("", h(1)), ("", h(2)), ("sql", h(3))}
    assert env.lookup([h(1), h(2)]).replica_scores[0].tier == Tier.T2
    msg.stats.hit_rate = 0.5
    env.index.apply_update(msg)
    assert [r.hit_rate for r in env.index.cache_state("t", "m").replicas] == [0.5]
    env.index.apply_event(
        pb.CacheEvent(type=pb.CacheEvent.ALL_CLEARED, replica_id="r1", model_id="m", tenant_id="t")
    )
    assert env.holds() == {}


# ---- batched PREFIX_EVICTED (additive field 8, docs/decisions.md) -----------------------------


def _fill(env: Env) -> None:
    for scheme in ("vllm", "sglang"):
        for adapter in ("", "sql"):
            for r in ("r1", "r2"):
                env.chain(r, [h(i) for i in range(6)], hash_scheme=scheme, entry_adapter=adapter)
    env.chain("r1", [h(i) for i in range(6)], model_id="other")


@pytest.mark.parametrize("adapter", ["", "sql", "nope"])
def test_batched_eviction_equals_one_event_per_hash(
    make_env: Callable[..., Env], adapter: str
) -> None:
    """prefix_hash then prefix_hashes, in order, each with contract-and-index.md §4.4's rule: the
    same holds, views and counts as one event per hash (duplicates and unknown hashes included)."""
    batched, single = make_env(), make_env()
    keys = [h(2), h(0), h(5), h(9), h(2), h(3)]
    for env in (batched, single):
        _fill(env)
    batched.event(EventType.PREFIX_EVICTED, "r1", keys[0], prefix_hashes=keys[1:],
                  adapter_id=adapter)
    for k in keys:
        single.event(EventType.PREFIX_EVICTED, "r1", k, adapter_id=adapter)
    assert batched.holds() == single.holds()
    assert batched.index.counts() == single.index.counts()
    assert batched.index.snapshot() == single.index.snapshot()
    assert batched.metrics.entries == single.metrics.entries
    gone = {k for k in keys} - {h(9)}
    left = batched.holds()
    assert not any(k[4] in gone and k[5] == "r1" and k[1] == "m" and adapter in ("", k[3])
                   for k in left)
    assert any(k[5] == "r2" for k in left)  # other replicas untouched


def test_batched_eviction_is_ignored_for_other_types_and_the_probe_tenant(env: Env) -> None:
    env.chain("r1", [h(1), h(2)])
    before = env.holds()
    for typ in (EventType.PREFIX_ADDED, EventType.REPLICA_UPDATED, EventType.TYPE_UNSPECIFIED):
        env.event(typ, "r1", h(1), prefix_hashes=[h(2)])
    env.event(EventType.PREFIX_EVICTED, "r1", h(1), prefix_hashes=[h(2)], tenant_id=PROBE_TENANT)
    assert env.holds() == before
    env.event(EventType.PREFIX_EVICTED, "r1", b"", prefix_hashes=[h(2)])  # empty first hash
    assert {k[4] for k in env.holds()} == {h(1)}


def test_batched_eviction_from_protobuf_and_an_old_reader(env: Env) -> None:
    pb = pytest.importorskip("inferencecache.v1alpha1.inferencecache_pb2")
    env.chain("r1", [h(1), h(2), h(3)])
    msg = pb.CacheEvent(type=pb.CacheEvent.PREFIX_EVICTED, replica_id="r1", model_id="m",
                        tenant_id="t", prefix_hash=h(1), prefix_hashes=[h(3)])
    env.index.apply_event(msg)
    assert {k[4] for k in env.holds()} == {h(2)}


def test_packed_update_equals_its_entries(make_env: Callable[..., Env]) -> None:
    """A LegacyRun is its entries applied one by one: adapter fallback, tier normalisation,
    int32 wrap, last write wins, the entry bound cutting inside a run."""
    from inferencecache.index import IndexSettings, LegacyRun, PackedUpdate, Update

    settings = IndexSettings(max_entries_per_update=7)
    packed, plain = make_env(settings=settings), make_env(settings=settings)
    runs: list[LegacyRun | Prefix] = [
        LegacyRun(h(1) + h(2) + h(1), [16, 2**31 + 5, 48], 0, ""),
        LegacyRun(h(3) + h(4), [-(2**31) - 1, 64], -4, "sql"),
        Prefix(block_hashes=[h(5), h(6)], block_token_counts=[16, 16], tier=2),
        LegacyRun(h(7) + h(8) + h(9), [1, 2, 3], 2, ""),
    ]
    flat: list[Prefix] = []
    for r in runs:
        if isinstance(r, LegacyRun):
            flat += [Prefix(prefix_hash=r.hashes[8 * i : 8 * i + 8], token_count=c, tier=r.tier,
                            adapter_id=r.adapter_id) for i, c in enumerate(r.token_counts)]
        else:
            flat.append(r)
    head: dict[str, Any] = {"replica_id": "r1", "model_id": "m", "tenant_id": "t",
                            "hash_scheme": "vllm", "timestamp_us": 1_000, "adapter_id": "upd"}
    packed.index.apply_update(PackedUpdate(entries=runs, **head))
    plain.index.apply_update(Update(prefixes=flat, **head))
    assert packed.holds() == plain.holds()
    assert packed.metrics.dropped == plain.metrics.dropped == {"too_many_entries": 2}
    assert packed.holds()[("t", "m", "vllm", "upd", h(1), "r1")][0] == 48  # last write wins
    with pytest.raises(ValueError):
        packed.index.apply_update(PackedUpdate(entries=[LegacyRun(h(1), [1, 2])], **head))
