"""Matching and scoring: contract-and-index.md §10 items 26-46."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from inferencecache.index import PROBE_TENANT, Reason, Stats, TenantPolicy, Tier
from tests.index.support import MIN, TTL, Env, h, ids

REL = 1e-5


def test_c10_26_probe_tenant_lookup_is_no_hint_with_zero_latency(env: Env) -> None:
    env.legacy("r1", h(1), 64)
    res = env.exact(h(1), tenant_id=PROBE_TENANT, adapter_id="a")
    assert res.reason_code == Reason.NO_HINT
    assert res.lookup_latency_us == 0 and res.replica_scores == [] and res.adapter_id == ""


@pytest.mark.parametrize(
    "empty", [{"tenant_id": ""}, {"model_id": ""}, {"hash_scheme": ""}], ids=["t", "m", "s"]
)
def test_c10_27_empty_key_fields_are_no_hint(env: Env, empty: dict[str, Any]) -> None:
    env.policy("", affinity_routing=True)
    env.policy("t", affinity_routing=True)
    env.legacy("r1", h(1), 64, tenant_id="")
    env.legacy("r1", h(1), 64, model_id="")
    env.legacy("r1", h(1), 64)
    res = env.exact(h(1), adapter_id="a", **empty)
    assert res.reason_code == Reason.NO_HINT and res.replica_scores == []
    assert res.adapter_id == "a"  # a post-index NO_HINT echoes the adapter
    res = env.lookup([h(1)], adapter_id="a", **empty)
    assert res.reason_code == Reason.NO_HINT


def test_c10_28_exact_hit_fields(env: Env) -> None:
    env.legacy("r1", h(1), 100, tier=2, age=6 * MIN)
    res = env.exact(h(1), 5)
    assert res.reason_code == Reason.PREFIX_MATCH
    (s,) = res.replica_scores
    assert (s.replica_id, s.matched_tokens, s.tier) == ("r1", 100, Tier.T2)
    assert s.estimated_cache_hit_prob == pytest.approx(0.8, rel=REL)
    assert s.score == pytest.approx(80, rel=REL)


def test_c10_29_ties_scheme_and_tenant_isolation(env: Env) -> None:
    for r in ("rc", "ra", "rb"):
        env.legacy(r, h(1), 64)
    res = env.exact(h(1))
    assert ids(res) == ["ra", "rb", "rc"]
    assert len({s.score for s in res.replica_scores}) == 1
    env.legacy("r9", h(2), 64, hash_scheme="vllm")
    assert env.exact(h(2), hash_scheme="sglang").reason_code != Reason.PREFIX_MATCH
    assert env.lookup([h(2)], hash_scheme="sglang").reason_code != Reason.PREFIX_MATCH
    env.legacy("rB", h(3), 64, tenant_id="B")
    assert "rB" not in ids(env.exact(h(3)))
    assert env.exact(h(3)).reason_code != Reason.PREFIX_MATCH


def test_c10_30_worked_example(env: Env) -> None:
    hs = [h(1), h(2), h(3)]
    env.chain("A", hs, 64, age=1 * MIN)
    env.chain("B", hs[:2], 64, age=2 * MIN)
    env.chain("C", hs[:1], 64, age=4 * MIN)
    res = env.lookup(hs, 64)
    assert res.reason_code == Reason.PREFIX_MATCH
    assert ids(res) == ["A", "B", "C"]
    got = [(s.score, s.matched_tokens) for s in res.replica_scores]
    assert got[0][0] == pytest.approx(192 * 29 / 30 * 2 / 3, rel=REL)
    assert got[0][0] == pytest.approx(123.73, abs=0.005)
    assert got[1][0] == pytest.approx(39.82, abs=0.005)
    assert got[2][0] == 0.0
    assert [m for _, m in got] == [192, 128, 64]
    # with the default policy (G1 64, G2 0.1) the answer is the same
    env.index.replace_config(type(env.index.config)())
    assert ids(env.lookup(hs, 64)) == ["A", "B", "C"]


def test_c10_31_run_stops_at_the_first_gap(env: Env) -> None:
    env.chain("r1", [h(1), h(2)])
    env.chain("r1", [h(4)])
    res = env.lookup([h(1), h(2), h(3), h(4)])
    assert res.replica_scores[0].matched_tokens == 32


def test_c10_32_request_counts_and_oldest_block_freshness(env: Env) -> None:
    env.chain("r1", [h(1)], [999], age=12 * MIN)
    env.chain("r1", [h(2)], [5], age=0)
    res = env.lookup([h(1), h(2)], [10, 20])
    (s,) = res.replica_scores
    assert s.matched_tokens == 30
    assert s.estimated_cache_hit_prob == pytest.approx(0.6, rel=REL)


def test_c10_33_chain_tier_and_legacy_blob_at_block_0(env: Env) -> None:
    env.chain("r1", [h(1)], tier=2)
    env.chain("r1", [h(2)], tier=1)
    assert env.lookup([h(1), h(2)]).replica_scores[0].tier == Tier.T2
    env.legacy("r2", h(10), 4096)  # a legacy blob hash
    env.legacy("r2", h(11), 4096)
    res = env.lookup([h(10), h(11)], [16, 16])
    (s,) = res.replica_scores
    assert s.replica_id == "r2" and s.matched_tokens == 32  # request counts, both held
    env.legacy("r3", h(20), 4096)
    res = env.lookup([h(20), h(21)], [16, 16])
    assert res.replica_scores[0].matched_tokens == 16  # C[0] only
    # a deeper collision never starts a match
    assert env.lookup([h(30), h(20)]).reason_code != Reason.PREFIX_MATCH


def test_c10_34_chain_miss_never_yields_tenant_hot(env: Env) -> None:
    env.chain("r1", [h(1), h(2)])
    env.stats("r1", hit_rate=0.9)
    res = env.lookup([h(5), h(1)])
    assert res.reason_code == Reason.NO_HINT
    assert env.exact(h(5)).reason_code == Reason.TENANT_HOT  # the exact path would


def test_c10_35_malformed_chain_is_no_hint_without_adapter(env: Env) -> None:
    env.policy(affinity_routing=True)
    env.chain("r1", [h(1)])
    for kw in (
        {"block_hashes": [h(1)], "block_token_counts": [16, 16]},
        {"block_hashes": [h(1)], "block_token_counts": []},
        {"block_hashes": [], "block_token_counts": [16]},
        {"block_hashes": [h(1), h(2)], "block_token_counts": [16], "prefix_hash": h(1)},
    ):
        res = env.lookup(adapter_id="a", **kw)  # type: ignore[arg-type]
        assert (res.reason_code, res.replica_scores, res.adapter_id) == (Reason.NO_HINT, [], "")
    # a packed hashes buffer whose length is not a multiple of 8 is malformed too
    res = env.lookup(block_hashes=h(1) + b"x", packed_hashes=True, block_token_counts=[16])
    assert res.reason_code == Reason.NO_HINT and res.adapter_id == ""


def test_c10_36_ttl_boundary_and_half_life(env: Env) -> None:
    env.legacy("r1", h(1), 64, age=TTL)
    env.legacy("r2", h(2), 64, age=TTL - 0.000001)
    env.legacy("r3", h(3), 64, age=TTL / 2)
    assert env.exact(h(1)).reason_code == Reason.NO_HINT
    assert ids(env.exact(h(2))) == ["r2"]
    assert env.exact(h(3)).replica_scores[0].estimated_cache_hit_prob == pytest.approx(0.5)
    env.chain("r4", [h(4)], age=TTL)
    assert env.lookup([h(4)]).reason_code == Reason.NO_HINT
    # per-tenant TTL
    env.policy(eviction_ttl=60.0)
    assert env.exact(h(3)).reason_code == Reason.NO_HINT


def _four_replica_scope(env: Env) -> None:
    env.legacy("x1", h(90), 64)
    env.legacy("x2", h(91), 64)


def test_c10_37_pressure_factor(env: Env) -> None:
    _four_replica_scope(env)
    env.legacy("big", h(1), 200, stats=Stats(pressure=0.9))
    env.legacy("small", h(1), 100, stats=Stats(pressure=0.0))
    res = env.exact(h(1))
    assert ids(res) == ["small", "big"]
    assert res.replica_scores[0].score == pytest.approx(50, rel=REL)
    assert res.replica_scores[1].score == pytest.approx(10, rel=REL)


def test_c10_38_stale_stats_pressure_is_ignored(env: Env) -> None:
    _four_replica_scope(env)
    env.stats("big", pressure=0.9, age=TTL + 1)
    env.legacy("big", h(1), 200)
    env.legacy("small", h(1), 100)
    res = env.exact(h(1))
    assert ids(res) == ["big", "small"]
    assert res.replica_scores[0].score == pytest.approx(100, rel=REL)


def test_c10_39_slo_bias(env: Env) -> None:
    _four_replica_scope(env)
    env.legacy("old", h(1), 200, age=TTL * 0.4)
    env.legacy("new", h(1), 100)

    def scores(ttft: int) -> dict[str, float]:
        return {s.replica_id: s.score for s in env.exact(h(1), ttft_ms=ttft).replica_scores}

    assert scores(0) == pytest.approx({"old": 60, "new": 50}, rel=REL)
    assert ids(env.exact(h(1))) == ["old", "new"]
    assert scores(50) == pytest.approx({"old": 96, "new": 100}, rel=REL)
    assert ids(env.exact(h(1), ttft_ms=50)) == ["new", "old"]
    assert scores(200) == pytest.approx({"old": 60, "new": 50}, rel=REL)
    assert scores(1000) == pytest.approx({"old": 60, "new": 50}, rel=REL)
    assert scores(-5) == pytest.approx({"old": 60, "new": 50}, rel=REL)


def test_c10_40_everyone_holds_it_means_affinity(make_env: Callable[..., Env]) -> None:
    env = make_env(defaults=True)
    for r in ("r0", "r1", "r2"):
        env.legacy(r, h(1), 128)
    res = env.exact(h(1), 128)
    assert res.reason_code == Reason.AFFINITY_HINT
    assert len(res.replica_scores) == 1 and res.replica_scores[0].score == 0.0


def test_c10_41_dp_factor(env: Env) -> None:
    env.legacy("only", h(1), 90)
    assert env.exact(h(1)).replica_scores[0].score == pytest.approx(90)  # one replica: 1
    env.legacy("x1", h(90), 64)
    env.legacy("x2", h(91), 64)
    assert env.exact(h(1)).replica_scores[0].score == pytest.approx(60, rel=REL)  # 1 of 3


def test_c10_42_dp_counts_replicas_of_other_adapters(env: Env) -> None:
    env.legacy("r1", h(1), 90)
    env.legacy("r2", h(5), 90, entry_adapter="sql")
    assert env.exact(h(1)).replica_scores[0].score == pytest.approx(45, rel=REL)


def test_c10_43_default_g1_floor(make_env: Callable[..., Env]) -> None:
    env = make_env(defaults=True)
    env.legacy("r1", h(1), 16)
    env.legacy("r1", h(2), 64)
    assert env.exact(h(1)).reason_code == Reason.AFFINITY_HINT
    res = env.exact(h(2))
    assert res.reason_code == Reason.PREFIX_MATCH and ids(res) == ["r1"]


def test_c10_44_g1_drops_short_runs(make_env: Callable[..., Env]) -> None:
    env = make_env(defaults=True)
    env.chain("long", [h(i) for i in range(8)])
    env.chain("short", [h(0)])
    res = env.lookup([h(i) for i in range(8)])
    assert res.reason_code == Reason.PREFIX_MATCH and ids(res) == ["long"]
    assert res.replica_scores[0].score == pytest.approx(64, rel=REL)


def test_c10_45_minimum_matched_zero_keeps_short_matches(env: Env) -> None:
    env.legacy("r1", h(1), 16)
    res = env.exact(h(1))
    assert res.reason_code == Reason.PREFIX_MATCH and ids(res) == ["r1"]


def test_c10_46_routing_floor(env: Env) -> None:
    env.legacy("r1", h(1), 16, age=TTL * 0.999)  # score 0.016
    env.policy(routing_floor_score=0.1)
    assert env.exact(h(1)).reason_code == Reason.NO_HINT
    env.policy(routing_floor_score=0.0)
    assert env.exact(h(1)).reason_code == Reason.PREFIX_MATCH
    env.policy(routing_floor_score=-5.0)
    assert env.exact(h(1)).reason_code == Reason.PREFIX_MATCH
    # the floor applies to the top score only
    _four_replica_scope(env)
    env.legacy("r2", h(1), 1000)
    env.policy(routing_floor_score=0.1)
    res = env.exact(h(1))
    assert ids(res) == ["r2", "r1"]
    assert TenantPolicy().routing_floor_score == 0.1
