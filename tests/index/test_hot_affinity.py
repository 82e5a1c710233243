"""TENANT_HOT, the miss classifier and AFFINITY_HINT: contract-and-index.md §10 items 47-58."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from inferencecache.index import EventType, IndexSettings, Reason, Tier
from tests.index.support import MIN, Env, h, ids

B1 = (16863443419780771464).to_bytes(8, "big")  # two_block_chain block 0 = ea06fc71a5ee6e88
B2 = (12466389667045779788).to_bytes(8, "big")


def test_c10_47_tenant_hot_example(env: Env) -> None:
    env.legacy("r1", h(1), 64)
    env.stats("r1", hit_rate=0.8, pressure=0.1, age=30)
    res = env.exact(h(2), adapter_id="a")
    assert res.reason_code == Reason.TENANT_HOT and res.adapter_id == "a"
    (s,) = res.replica_scores
    assert s.score == pytest.approx(0.648, rel=1e-5)
    assert (s.matched_tokens, s.tier) == (0, Tier.UNSPECIFIED)
    assert s.estimated_cache_hit_prob == pytest.approx(0.8, rel=1e-6)


def test_c10_48_warm_replica_of_another_scheme_is_no_candidate(env: Env) -> None:
    env.legacy("r1", h(1), 64, hash_scheme="sglang")
    env.stats("r1", hit_rate=0.9)
    assert env.exact(h(2)).reason_code == Reason.UNKNOWN_HASH_SCHEME
    env.legacy("r2", h(3), 64)  # a cold replica serving vllm
    assert env.exact(h(2)).reason_code == Reason.NO_HINT
    env.stats("r2", hit_rate=0.5)
    res = env.exact(h(2))
    assert res.reason_code == Reason.TENANT_HOT and ids(res) == ["r2"]


def test_c10_49_tenant_hot_disqualifiers(env: Env) -> None:
    env.legacy("old", h(1), 64)
    env.legacy("cold", h(1), 64)
    env.legacy("edge", h(1), 64)
    env.stats("old", hit_rate=0.9, age=5 * MIN)  # age == max age: strict
    env.stats("cold", hit_rate=0.09)
    env.stats("edge", hit_rate=0.1)  # inclusive
    env.stats("nohold", hit_rate=0.9)
    res = env.exact(h(2))
    assert res.reason_code == Reason.TENANT_HOT and ids(res) == ["edge"]
    env.stats("almost", hit_rate=0.9, age=5 * MIN - 1)
    env.legacy("almost", h(1), 64)
    assert ids(env.exact(h(2))) == ["edge", "almost"]  # 0.1 vs 0.9 x (1 s / 300 s)


def test_c10_50_tenant_hot_max_age_zero_disables(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=IndexSettings(tenant_hot_max_age=0))
    env.legacy("r1", h(1), 64)
    env.stats("r1", hit_rate=0.9)
    assert env.exact(h(2)).reason_code == Reason.NO_HINT
    assert env.exact(h(2), tenant_id="x").reason_code == Reason.UNKNOWN_TENANT
    assert env.exact(h(2), model_id="x").reason_code == Reason.UNKNOWN_MODEL
    assert env.exact(h(2), hash_scheme="x").reason_code == Reason.UNKNOWN_HASH_SCHEME


def test_c10_51_enable_tenant_hot_false(env: Env) -> None:
    env.legacy("r1", h(1), 64)
    env.stats("r1", hit_rate=0.9)
    env.policy(enable_tenant_hot=False)
    assert env.exact(h(2)).reason_code == Reason.NO_HINT
    env.policy(enable_tenant_hot=False, affinity_routing=True)
    res = env.exact(h(2))
    assert res.reason_code == Reason.AFFINITY_HINT and ids(res) == ["r1"]


def test_c10_52_classifier(env: Env) -> None:
    env.legacy("r1", h(1), 64)
    assert env.exact(h(2), tenant_id="x").reason_code == Reason.UNKNOWN_TENANT
    assert env.exact(h(2), model_id="x").reason_code == Reason.UNKNOWN_MODEL
    assert env.exact(h(2), hash_scheme="x").reason_code == Reason.UNKNOWN_HASH_SCHEME
    res = env.exact(h(2), tenant_id="x", hash_scheme="y")
    assert res.reason_code == Reason.UNKNOWN_TENANT
    assert env.exact(h(2)).reason_code == Reason.NO_HINT


def test_c10_53_cold_start_chain_misses_and_unknown_beats_affinity(env: Env) -> None:
    env.policy(affinity_routing=True)
    env.policy("x", affinity_routing=True)
    assert env.exact(h(1)).reason_code == Reason.NO_HINT  # globally empty index
    assert env.lookup([h(1)]).reason_code == Reason.NO_HINT
    env.legacy("r1", h(1), 64)
    assert env.lookup([h(2)], tenant_id="x").reason_code == Reason.UNKNOWN_TENANT
    assert env.lookup([h(2)], model_id="x").reason_code == Reason.UNKNOWN_MODEL
    assert env.lookup([h(2)], hash_scheme="x").reason_code == Reason.UNKNOWN_HASH_SCHEME
    assert env.lookup([h(2)]).reason_code == Reason.AFFINITY_HINT


def test_c10_54_last_key_removed_turns_tenant_unknown(env: Env) -> None:
    env.legacy("r1", h(1), 64)
    env.legacy("r1", h(1), 64, tenant_id="other")
    assert env.exact(h(2)).reason_code == Reason.NO_HINT
    env.event(EventType.PREFIX_EVICTED, "r1", h(1))
    assert env.exact(h(2)).reason_code == Reason.UNKNOWN_TENANT


def test_c10_55_unseen_adapter_is_a_novel_prefix(env: Env) -> None:
    env.legacy("r1", h(1), 64, entry_adapter="sql")
    assert env.exact(h(1), adapter_id="new").reason_code == Reason.NO_HINT
    assert env.lookup([h(1)], adapter_id="new").reason_code == Reason.NO_HINT
    env.policy(affinity_routing=True)
    res = env.lookup([h(1)], adapter_id="new")
    assert res.reason_code == Reason.AFFINITY_HINT and res.adapter_id == "new"
    env.stats("r1", hit_rate=0.5)
    assert env.exact(h(1), adapter_id="new").reason_code == Reason.TENANT_HOT
    assert env.lookup([h(1)], adapter_id="new").reason_code == Reason.AFFINITY_HINT


def test_c10_56_novel_prefix_affinity(env: Env) -> None:
    env.policy(affinity_routing=True)
    env.legacy("r1", h(1), 64)
    res = env.lookup([h(5)], adapter_id="a")
    assert res.reason_code == Reason.AFFINITY_HINT
    (s,) = res.replica_scores
    assert (s.replica_id, s.score, s.matched_tokens, s.estimated_cache_hit_prob, s.tier) == (
        "r1",
        0.0,
        0,
        0.0,
        0,
    )
    assert res.adapter_id == "a"


def test_c10_57_affinity_seeds(env: Env) -> None:
    # contract-and-index.md §8.3 self-check of the seed arithmetic itself
    seed = b"\x00\x00\x00\x08" + B1
    assert seed.hex() == "00000008ea06fc71a5ee6e88"
    head = hashlib.sha256(seed).digest()[:8]
    assert head.hex() == "a75b110ceab12ed9" and int.from_bytes(head, "big") % 3 == 1
    env.policy(affinity_routing=True)
    for r in ("r2", "r0", "r1"):
        env.legacy(r, h(1), 64)
    env.legacy("r9", h(1), 64, hash_scheme="sglang")  # serves another scheme: not eligible
    for _ in range(2):  # stable on repeat
        assert ids(env.lookup([B1])) == ["r1"]
        assert ids(env.lookup([B1], packed_hashes=False)) == ["r1"]
        assert ids(env.lookup([B1, B2])) == ["r0"]
        assert ids(env.exact(B1)) == ["r0"]
    packed = env.lookup(block_hashes=B1 + B2, packed_hashes=True, block_token_counts=[16, 16])
    assert ids(packed) == ["r0"]


def test_c10_58_no_affinity_without_switch_serving_or_seed(env: Env) -> None:
    env.legacy("r1", h(1), 64)
    assert env.lookup([h(5)]).reason_code == Reason.NO_HINT  # affinity off
    env.policy(affinity_routing=True)
    assert env.exact(b"").reason_code == Reason.NO_HINT  # no seed: empty prefix_hash
    env.event(EventType.ALL_CLEARED, "r1")
    assert env.lookup([h(5)]).reason_code == Reason.NO_HINT  # globally empty: no one serves
