"""GetCacheState, the gauge, /snapshot content, config swaps: contract-and-index.md §10 items 83-89
(index side; the HTTP status codes of 85/86/88 are the server's)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import pytest

from inferencecache import fingerprint
from inferencecache.index import (
    PROBE_TENANT,
    EventType,
    IndexConfig,
    Prefix,
    Prober,
    Reason,
    Stats,
    Update,
    decode_policy_body,
    rfc3339_us,
)
from tests.index.support import TTL, Env, h, ids


def test_c10_83_get_cache_state(env: Env) -> None:
    env.legacy(
        "rb",
        h(1),
        64,
        stats=Stats(
            hit_rate=0.5, pressure=0.25, cache_memory_bytes=10, t2_hit_tokens=3, t2_query_tokens=4
        ),
    )
    env.legacy("ra", h(1), 64, hash_scheme="sglang", stats=Stats(hit_rate=0.75))
    env.legacy("ra", h(1), 64, entry_adapter="sql")
    env.stats("rc", age=TTL + 5)  # stale but unswept: still listed
    env.legacy("rz", h(5), 64, model_id="other", stats=Stats(hit_rate=1))
    cs = env.index.cache_state("t", "m")
    assert [r.replica_id for r in cs.replicas] == ["ra", "rb", "rc"]
    rb = cs.replicas[1]
    assert (
        rb.cache_memory_bytes,
        rb.hit_rate,
        rb.pressure,
        rb.t2_hit_tokens,
        rb.t2_query_tokens,
    ) == (10, 0.5, 0.25, 3, 4)
    assert (cs.total_prefixes, cs.hot_prefixes) == (3, 0)  # vllm, sglang, sql partitions
    probe = env.index.cache_state(PROBE_TENANT, "m")
    assert (probe.replicas, probe.total_prefixes, probe.hot_prefixes) == ([], 0, 0)


def test_c10_84_index_entries_gauge(env: Env) -> None:
    env.chain("r1", [h(1), h(2)])
    env.chain("r2", [h(1), h(2)])  # same keys: still 2
    env.chain("r1", [h(1)], entry_adapter="x")
    env.chain("r1", [h(7)], model_id="m2")
    assert env.metrics.entries == {"m": 3, "m2": 1}
    prober = Prober(env.index)
    prober.run(b'{"backend":"b","model":"m","hashScheme":"vllm"}')
    assert env.metrics.entries == {"m": 3, "m2": 1}
    env.event(EventType.ALL_CLEARED, "r1")
    assert env.metrics.entries == {"m": 2, "m2": 1}
    env.event(EventType.ALL_CLEARED, "r2")
    assert env.metrics.entries == {"m": 0, "m2": 1}
    env.clock.advance(TTL)
    env.index.sweep()
    assert env.metrics.entries == {"m": 0, "m2": 0}


def test_c10_85_snapshot_totals_and_probe_exclusion(env: Env) -> None:
    env.chain("r1", [h(1), h(2)], entry_adapter="a")
    env.chain("r2", [h(1)], tenant_id="u")
    env.legacy("r3", h(1), 64, tenant_id="")
    env.index.apply_update(
        Update(
            replica_id="__probe-x",
            tenant_id=PROBE_TENANT,
            model_id="m",
            hash_scheme="vllm",
            prefixes=[Prefix(prefix_hash=h(1), token_count=16)],
            stats=Stats(hit_rate=1),
        ),
        allow_probe=True,
    )
    snap = env.index.snapshot()
    json.dumps(snap)  # JSON-ready
    tenants = cast(list[dict[str, Any]], snap["tenants"])
    assert sum(t["indexEntries"] for t in tenants) == snap["totalPrefixes"] == 4
    assert [t["tenantId"] for t in tenants] == ["", "t", "u"]
    text = json.dumps(snap)
    assert PROBE_TENANT not in text and "__probe-x" not in text
    assert snap["hotPrefixes"] == 0


def test_c10_86_config_swap_restores_defaults(env: Env) -> None:
    env.legacy("r1", h(1), 16)
    assert env.exact(h(1)).reason_code == Reason.PREFIX_MATCH  # G1 off under TEST_POLICY
    env.index.replace_config(IndexConfig())  # no entry for t: defaults (G1 64, affinity on)
    assert env.exact(h(1)).reason_code == Reason.AFFINITY_HINT


def test_c10_88_policy_body_versions(env: Env) -> None:
    env.legacy("r1", h(1), 16)
    env.index.replace_config(decode_policy_body(b'{"version":7,"policies":[{"namespace":"t"}]}'))
    res = env.exact(h(1))
    assert res.reason_code == Reason.PREFIX_MATCH and ids(res) == ["r1"]
    assert env.index.policy("t").ttl_us == 30 * 60 * 1_000_000
    env.index.replace_config(decode_policy_body(b'{"version":3,"policies":[{"namespace":"t"}]}'))
    assert env.exact(h(1)).reason_code == Reason.AFFINITY_HINT
    assert env.index.policy("t").minimum_matched_tokens == 64
    assert env.index.policy("t").affinity_routing is True
    body = b'{"version":7,"policies":[{"namespace":"t","evictionTTL":0,"affinityRouting":false}]}'
    env.index.replace_config(decode_policy_body(body))
    assert env.index.policy("t").ttl_us == 30 * 60 * 1_000_000


def test_c10_89_snapshot_rows_of_holds_only_and_stats_only(env: Env) -> None:
    env.legacy("holds", h(1), 64, tenant_id="")
    env.stats("statsonly", hit_rate=0.8, tenant_id="")
    snap = env.index.snapshot()
    rows = {r["replicaId"]: r for r in cast(list[dict[str, Any]], snap["replicas"])}
    assert rows["holds"] == {
        "replicaId": "holds",
        "cacheMemoryBytes": 0,
        "hitRate": 0.0,
        "pressure": 0.0,
        "lastUpdate": "0001-01-01T00:00:00Z",
        "prefixCount": 1,
        "lastEventAt": rfc3339_us(env.now),
    }
    assert rows["statsonly"] == {
        "replicaId": "statsonly",
        "cacheMemoryBytes": 0,
        "hitRate": 0.8,
        "pressure": 0.0,
        "lastUpdate": rfc3339_us(env.now),
        "prefixCount": 0,
        "lastEventAt": "0001-01-01T00:00:00Z",
        "statsReported": True,
    }
    assert snap["tenants"] == [
        {
            "tenantId": "",
            "indexEntries": 1,
            "hitRate": 0.8,
            "hitRateReported": True,
            "memoryUsed": 0,
        }
    ]


def test_snapshot_row_merges_models_and_picks_latest_stats(env: Env) -> None:
    env.legacy("r1", h(1), 64, age=100, stats=Stats(hit_rate=0.25, t2_hit_tokens=5))
    env.legacy(
        "r1",
        h(2),
        64,
        model_id="m2",
        age=10,
        stats=Stats(hit_rate=0.5, cache_memory_bytes=9, t2_query_tokens=7),
    )
    env.legacy("r2", h(2), 64, model_id="m2", stats=Stats(hit_rate=1.0))
    snap = env.index.snapshot()
    assert snap["replicas"] == [
        {
            "replicaId": "r1",
            "tenant": "t",
            "cacheMemoryBytes": 9,
            "hitRate": 0.5,
            "pressure": 0.0,
            "lastUpdate": rfc3339_us(env.ts(10)),
            "prefixCount": 2,
            "lastEventAt": rfc3339_us(env.ts(10)),
            "statsReported": True,
            "t2QueryTokens": 7,
        },
        {
            "replicaId": "r2",
            "tenant": "t",
            "cacheMemoryBytes": 0,
            "hitRate": 1.0,
            "pressure": 0.0,
            "lastUpdate": rfc3339_us(env.now),
            "prefixCount": 1,
            "lastEventAt": rfc3339_us(env.now),
            "statsReported": True,
        },
    ]
    assert snap["tenants"] == [
        {
            "tenantId": "t",
            "indexEntries": 2,
            "hitRate": 0.75,
            "hitRateReported": True,
            "memoryUsed": 0,
        }
    ]


def test_snapshot_empty_lists() -> None:
    from inferencecache.index import Index

    assert Index().snapshot() == {
        "replicas": [],
        "tenants": [],
        "totalPrefixes": 0,
        "hotPrefixes": 0,
    }


@pytest.mark.parametrize(
    ("us", "text"),
    [
        (0, "1970-01-01T00:00:00Z"),
        (1_700_000_000_000_000, "2023-11-14T22:13:20Z"),
        (1_700_000_000_500_000, "2023-11-14T22:13:20.5Z"),
        (1_700_000_000_000_001, "2023-11-14T22:13:20.000001Z"),
        (-1, "1969-12-31T23:59:59.999999Z"),
        (-(2**63), "0001-01-01T00:00:00Z"),
        (2**63 - 1, "9999-12-31T23:59:59.999999Z"),
    ],
)
def test_rfc3339_like_go(us: int, text: str) -> None:
    assert rfc3339_us(us) == text


def test_c10_87_golden_vectors_through_the_pipeline(make_env: Callable[..., Env]) -> None:
    """Index side of item 87: token_ids fingerprint to the contract-and-index.md §8.2 bytes, partial
    tails never change a result, sub-block input yields nothing."""
    env = make_env()
    b1 = (16863443419780771464).to_bytes(8, "big")
    b2 = (12466389667045779788).to_bytes(8, "big")
    assert b1.hex() == "ea06fc71a5ee6e88"
    env.chain("r1", [b1, b2])
    tokens = list(range(1, 33))
    for extra in ([], [7], list(range(15))):
        res = env.lookup(token_ids=tokens + extra)
        assert res.reason_code == Reason.PREFIX_MATCH
        assert res.replica_scores[0].matched_tokens == 32
    assert env.lookup(token_ids=list(range(1, 17))).replica_scores[0].matched_tokens == 16
    assert env.lookup(token_ids=list(range(10))).reason_code == Reason.NO_HINT
    assert fingerprint.chain(list(range(1, 33)), 16)[0] == [b1, b2]
