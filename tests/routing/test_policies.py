"""Bookkeeping of every routing policy: pure calls, no sockets, no clocks."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferencecache import fingerprint
from inferencecache.routing import (
    POLICY_NAMES,
    ApproximatePolicy,
    CacheAwarePolicy,
    Hint,
    OraclePolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RouteInput,
    make_policy,
    parse_params,
)
from inferencecache.routing import reasons as R

B = 4
REPLICAS = ["r0", "r1", "r2"]


def route(
    tokens: list[int],
    *,
    adapter: str = "",
    model: str = "m",
    hint: Hint | None = None,
    oracle: dict[str, int] | None = None,
    load: dict[str, int] | None = None,
) -> RouteInput:
    return RouteInput(
        tenant_id="t",
        model_id=model,
        adapter_id=adapter,
        tokens=tokens,
        chain=fingerprint.chain_packed(tokens, B),
        block_size=B,
        hint=hint,
        oracle=oracle,
        load=load,
    )


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * B)]


# -- round robin / random ------------------------------------------------------------------------


def test_round_robin_rotates_over_healthy():
    p = RoundRobinPolicy()
    picks = [p.choose(route(prompt(1, 2)), REPLICAS) for _ in range(6)]
    assert [d.replica for d in picks] == REPLICAS * 2
    assert {d.reason for d in picks} == {R.ROUND_ROBIN}
    assert not any(d.fallback for d in picks)


def test_round_robin_only_picks_healthy():
    p = RoundRobinPolicy()
    picks = {p.choose(route([]), ["r0", "r2"]).replica for _ in range(10)}
    assert picks == {"r0", "r2"}


def test_random_is_seeded_and_uniform_over_healthy():
    a, b = RandomPolicy(seed=7), RandomPolicy(seed=7)
    seq_a = [a.choose(route([]), REPLICAS).replica for _ in range(300)]
    seq_b = [b.choose(route([]), REPLICAS).replica for _ in range(300)]
    assert seq_a == seq_b
    counts = Counter(seq_a)
    assert set(counts) == set(REPLICAS)
    assert min(counts.values()) > 60  # 100 expected each
    other = [RandomPolicy(seed=8).choose(route([]), REPLICAS).replica for _ in range(1)]
    assert other[0] in REPLICAS
    assert {RandomPolicy(seed=1).choose(route([]), ["r1"]).reason} == {R.RANDOM}


# -- cache_aware ---------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [R.PREFIX_MATCH, R.TENANT_HOT, R.AFFINITY_HINT])
def test_cache_aware_routes_on_routable_codes(code):
    p = CacheAwarePolicy()
    d = p.choose(route(prompt(1, 2), hint=Hint(code, ("r2", "r0"))), REPLICAS)
    assert (d.replica, d.reason, d.fallback) == ("r2", code, False)
    assert (p.routed, p.fallbacks) == (1, 0)


def test_cache_aware_takes_next_ranked_healthy_replica():
    p = CacheAwarePolicy()
    d = p.choose(route([], hint=Hint(R.PREFIX_MATCH, ("r2", "r1"))), ["r0", "r1"])
    assert (d.replica, d.reason, d.fallback) == ("r1", R.PREFIX_MATCH, False)


def test_cache_aware_top_only_falls_back_when_top_is_unhealthy():
    p = CacheAwarePolicy(follow_ranked=False)
    d = p.choose(route([], hint=Hint(R.PREFIX_MATCH, ("r2", "r1"))), ["r0", "r1"])
    assert d.fallback and d.reason == R.HINTED_REPLICA_UNHEALTHY and d.replica == "r0"


def test_cache_aware_ignores_replicas_it_does_not_know():
    p = CacheAwarePolicy()
    d = p.choose(route([], hint=Hint(R.AFFINITY_HINT, ("other-pod",))), REPLICAS)
    assert d.fallback and d.reason == R.HINTED_REPLICA_UNHEALTHY


@pytest.mark.parametrize(
    "code",
    [R.NO_HINT, R.TIMEOUT, R.UNKNOWN_TENANT, R.UNKNOWN_MODEL, R.UNKNOWN_HASH_SCHEME,
     R.POLICY_REQUIRES_CHAIN, R.HINT_TIMEOUT, R.HINT_ERROR, R.HINT_SKIPPED],
)
def test_cache_aware_falls_back_round_robin_on_other_codes(code):
    p = CacheAwarePolicy()
    picks = [p.choose(route([], hint=Hint(code, ("r1",))), REPLICAS) for _ in range(3)]
    assert [d.replica for d in picks] == REPLICAS  # round robin, not the listed replica
    assert all(d.fallback and d.reason == code for d in picks)
    assert (p.routed, p.fallbacks) == (0, 3)


def test_cache_aware_without_hint_and_with_unknown_code():
    p = CacheAwarePolicy()
    d = p.choose(route([], hint=None), REPLICAS)
    assert d.fallback and d.reason == R.HINT_UNAVAILABLE
    d = p.choose(route([], hint=Hint("SOMETHING_NEW", ("r0",))), REPLICAS)
    assert d.fallback and d.reason == R.UNRECOGNIZED and d.replica == "r1"
    d = p.choose(route([], hint=Hint(R.PREFIX_MATCH, ())), REPLICAS)
    assert d.fallback and d.reason == R.NO_HINT


def test_cache_aware_fallback_rotation_is_not_disturbed_by_routed_requests():
    p = CacheAwarePolicy()
    out = []
    for i in range(4):
        p.choose(route([], hint=Hint(R.PREFIX_MATCH, ("r2",))), REPLICAS)
        out.append(p.choose(route([], hint=Hint(R.NO_HINT)), REPLICAS).replica)
        assert i + 1 == p.routed == p.fallbacks
    assert out == ["r0", "r1", "r2", "r0"]


# -- oracle --------------------------------------------------------------------------------------


def test_oracle_longest_true_prefix_wins():
    p = OraclePolicy()
    d = p.choose(route([], oracle={"r0": 16, "r1": 64, "r2": 32}), REPLICAS)
    assert (d.replica, d.reason, d.fallback) == ("r1", R.ORACLE_PREFIX, False)


def test_oracle_only_considers_healthy():
    p = OraclePolicy()
    d = p.choose(route([], oracle={"r0": 16, "r1": 64}), ["r0", "r2"])
    assert d.replica == "r0"


def test_oracle_ties_go_to_least_loaded_then_round_robin():
    p = OraclePolicy()
    o = {"r0": 32, "r1": 32, "r2": 0}
    d = p.choose(route([], oracle=o, load={"r0": 3, "r1": 1, "r2": 0}), REPLICAS)
    assert d.replica == "r1"
    picks = [p.choose(route([], oracle=o), REPLICAS).replica for _ in range(4)]
    assert sorted(set(picks)) == ["r0", "r1"] and picks[0] != picks[1]


def test_oracle_no_match_and_no_view():
    p = OraclePolicy()
    d = p.choose(route([], oracle={}, load={"r0": 2, "r1": 0, "r2": 2}), REPLICAS)
    assert (d.replica, d.reason, d.fallback) == ("r1", R.ORACLE_NO_MATCH, False)
    picks = [p.choose(route([]), REPLICAS) for _ in range(3)]
    assert [d.replica for d in picks] == REPLICAS
    assert all(d.fallback and d.reason == R.ORACLE_UNAVAILABLE for d in picks)


# -- approximate ---------------------------------------------------------------------------------


def dispatch(p: ApproximatePolicy, r: RouteInput, healthy=REPLICAS) -> str:
    d = p.choose(r, healthy)
    p.observe(r, d.replica)
    return d.replica


def test_approximate_sends_a_repeated_prefix_to_the_same_replica():
    p = ApproximatePolicy()
    first = dispatch(p, route(prompt(1, 4)))
    d = p.choose(route(prompt(1, 4) + [9] * B), REPLICAS)
    assert (d.replica, d.reason) == (first, R.APPROX_PREFIX)
    assert p.matched_blocks(route(prompt(1, 4)), first) == 4


def test_approximate_new_prefixes_spread_to_the_emptiest_then_least_recent():
    p = ApproximatePolicy()
    picks = [dispatch(p, route(prompt(s, 2))) for s in range(1, 4)]
    assert sorted(picks) == REPLICAS  # each new prefix to a replica that remembers nothing
    d = p.choose(route(prompt(9, 2)), REPLICAS)
    assert d.reason == R.APPROX_NEW and d.replica == picks[0]  # equal sizes: least recent


def test_approximate_longest_remembered_prefix_wins():
    p = ApproximatePolicy()
    shared = prompt(1, 2)
    p.observe(route(shared), "r0")
    p.observe(route(shared + prompt(2, 3)), "r1")
    d = p.choose(route(shared + prompt(2, 3) + prompt(3, 1)), REPLICAS)
    assert (d.replica, d.reason) == ("r1", R.APPROX_PREFIX)
    d = p.choose(route(shared + prompt(5, 1)), REPLICAS)  # both hold 2 blocks: least recent
    assert d.replica == "r0"


def test_approximate_skips_unhealthy_replicas_memory():
    p = ApproximatePolicy()
    p.observe(route(prompt(1, 3)), "r0")
    d = p.choose(route(prompt(1, 3)), ["r1", "r2"])
    assert d.reason == R.APPROX_NEW and d.replica in ("r1", "r2")


def test_approximate_partitions_by_model_and_adapter():
    p = ApproximatePolicy()
    p.observe(route(prompt(1, 3), adapter="sql"), "r2")
    assert p.choose(route(prompt(1, 3), adapter="sql"), REPLICAS).replica == "r2"
    assert p.choose(route(prompt(1, 3)), REPLICAS).reason == R.APPROX_NEW
    assert p.choose(route(prompt(1, 3), adapter="chat"), REPLICAS).reason == R.APPROX_NEW
    assert p.choose(route(prompt(1, 3), model="m2", adapter="sql"), REPLICAS).reason == (
        R.APPROX_NEW
    )


def test_approximate_capacity_is_an_lru_per_replica_evicting_deep_blocks_first():
    p = ApproximatePolicy(capacity_blocks=4)
    a, b = prompt(1, 3), prompt(2, 2)
    p.observe(route(a), "r0")
    assert p.remembered_blocks("r0") == 3
    p.observe(route(b), "r0")  # 5 blocks > 4: a's deepest block goes first
    assert p.remembered_blocks("r0") == 4
    assert p.matched_blocks(route(a), "r0") == 2
    assert p.matched_blocks(route(b), "r0") == 2
    p.observe(route(a), "r0")  # touch a again: b's deepest block goes now
    assert p.matched_blocks(route(a), "r0") == 3
    assert p.matched_blocks(route(b), "r0") == 1
    assert p.tracked_keys == 4


def test_approximate_eviction_on_one_replica_keeps_the_others_memory():
    p = ApproximatePolicy(capacity_blocks=2)
    p.observe(route(prompt(1, 2)), "r0")
    p.observe(route(prompt(1, 2)), "r1")
    p.observe(route(prompt(2, 2)), "r0")
    assert p.matched_blocks(route(prompt(1, 2)), "r0") == 0
    assert p.matched_blocks(route(prompt(1, 2)), "r1") == 2
    assert p.choose(route(prompt(1, 2)), REPLICAS).replica == "r1"


def test_approximate_min_match_and_threshold():
    p = ApproximatePolicy(min_match_blocks=2)
    p.observe(route(prompt(1, 1)), "r1")
    assert p.choose(route(prompt(1, 1) + prompt(2, 3)), REPLICAS).reason == R.APPROX_NEW
    q = ApproximatePolicy(match_threshold=0.5)
    q.observe(route(prompt(1, 1)), "r1")
    assert q.choose(route(prompt(1, 1) + prompt(2, 3)), REPLICAS).reason == R.APPROX_NEW
    assert q.choose(route(prompt(1, 1) + prompt(2, 1)), REPLICAS).reason == R.APPROX_PREFIX


def test_approximate_balance_guard_overrides_a_prefix_on_a_hot_replica():
    p = ApproximatePolicy(balance_abs_threshold=4, balance_rel_threshold=2.0)
    p.observe(route(prompt(1, 3)), "r0")
    calm = p.choose(route(prompt(1, 3), load={"r0": 4, "r1": 1, "r2": 1}), REPLICAS)
    assert (calm.replica, calm.reason) == ("r0", R.APPROX_PREFIX)
    hot = p.choose(route(prompt(1, 3), load={"r0": 10, "r1": 2, "r2": 1}), REPLICAS)
    assert (hot.replica, hot.reason) == ("r2", R.APPROX_BALANCE)


def test_approximate_new_prefix_prefers_least_loaded():
    p = ApproximatePolicy()
    d = p.choose(route(prompt(1, 2), load={"r0": 2, "r1": 2, "r2": 1}), REPLICAS)
    assert d.replica == "r2"


def test_approximate_prompt_shorter_than_a_block():
    p = ApproximatePolicy()
    p.observe(route([1, 2]), "r0")
    assert p.tracked_keys == 0
    assert p.choose(route([1, 2]), REPLICAS).reason == R.APPROX_NEW


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 6), st.sampled_from(REPLICAS)),
        min_size=1,
        max_size=40,
    ),
    capacity=st.integers(1, 8),
)
def test_approximate_memory_bound_and_owner_consistency(ops, capacity):
    p = ApproximatePolicy(capacity_blocks=capacity)
    for seed, blocks, replica in ops:
        p.observe(route(prompt(seed, blocks)), replica)
        assert p.remembered_blocks(replica) <= capacity
    assert p.tracked_keys <= capacity * len(REPLICAS)
    # owner masks agree with the per-replica LRUs, both ways
    from_lru = {(k, r) for r, lru in p._lru.items() for k in lru}
    from_owners = {(k, r) for k, m in p._owners.items() for r, b in p._bits.items() if m & b}
    assert from_lru == from_owners


# -- registry ------------------------------------------------------------------------------------


def test_make_policy_builds_every_policy_fresh():
    assert POLICY_NAMES == ("round_robin", "random", "approximate", "cache_aware", "oracle")
    for name in POLICY_NAMES:
        a, b = make_policy(name), make_policy(name)
        assert a.name == name and a is not b
    assert make_policy("cache_aware").needs_hint and make_policy("oracle").needs_oracle
    assert not make_policy("approximate").needs_hint
    assert make_policy("approximate", capacity_blocks=7).capacity_blocks == 7  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("lru", {}, "unknown routing policy 'lru'"),
        ("random", {"seeed": 1}, "has no parameter 'seeed'"),
        ("approximate", {"capacity_blocks": 0}, "capacity_blocks must be >= 1"),
        ("round_robin", {"x": 1}, "has: none"),
    ],
)
def test_make_policy_errors_are_one_line_value_errors(name, params, message):
    with pytest.raises(ValueError, match=message) as e:
        make_policy(name, **params)
    assert "\n" not in str(e.value)


def test_parse_params_types_values_from_defaults():
    assert parse_params("capacity_blocks=64, match-threshold=0.5", "approximate") == {
        "capacity_blocks": 64,
        "match_threshold": 0.5,
    }
    assert parse_params("follow_ranked=false", "cache_aware") == {"follow_ranked": False}
    assert parse_params("", "random") == {}
    with pytest.raises(ValueError, match="not a valid int"):
        parse_params("seed=x", "random")
    with pytest.raises(ValueError, match="not name=value"):
        parse_params("seed", "random")
    with pytest.raises(ValueError, match="unknown routing policy"):
        parse_params("", "nope")
