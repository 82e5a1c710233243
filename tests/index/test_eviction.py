"""TTL sweep, global cap, tenant quotas: contract-and-index.md §10 items 76-82."""

from __future__ import annotations

from collections.abc import Callable

from inferencecache.index import PROBE_TENANT, IndexSettings, Prefix, Stats, Update
from tests.index.support import MIN, TTL, Env, h


def _keys(env: Env) -> set[tuple[str, str, str, str, bytes, str]]:
    return set(env.holds())


def test_c10_76_sweep_per_tenant_ttl(env: Env) -> None:
    env.policy("short", eviction_ttl=10 * MIN)
    env.policy("lfu", eviction="lfu")
    env.legacy("r1", h(1), 64, tenant_id="short", age=15 * MIN)
    env.legacy("r1", h(2), 64, tenant_id="short", age=5 * MIN)
    env.legacy("r1", h(1), 64, age=15 * MIN)
    env.legacy("r1", h(3), 64, age=TTL)  # exactly TTL: swept
    env.legacy("r1", h(1), 64, tenant_id="lfu", age=TTL + 1)
    env.stats("r1", age=TTL, tenant_id="short")  # liveness older than 10 min: expires
    env.stats("r2", age=TTL - 1)  # default tenant: alive
    env.stats("r3", age=TTL)  # exactly TTL: expires
    env.index.sweep()
    assert {(k[0], k[4]) for k in env.holds()} == {("short", h(2)), ("t", h(1))}
    assert env.metrics.evictions == {("lru", "ttl"): 2, ("lfu", "ttl"): 1}
    assert env.index.cache_state("short", "m").replicas == []
    assert [r.replica_id for r in env.index.cache_state("t", "m").replicas] == ["r2"]
    assert env.metrics.entries == {"m": 2}


def test_c10_77_cap_evicts_the_oldest_lru_hold(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=IndexSettings(max_holds=2))
    env.legacy("r1", h(1), 64, age=30)
    env.legacy("r1", h(2), 64, age=20)
    env.legacy("r2", h(3), 64, age=10)
    assert {k[4] for k in env.holds()} == {h(2), h(3)}
    assert env.metrics.evictions == {("lru", "cap"): 1}
    # the newest can be the victim if it is the oldest by timestamp
    env.legacy("r2", h(4), 64, age=40)
    assert {k[4] for k in env.holds()} == {h(2), h(3)}
    assert env.metrics.evictions == {("lru", "cap"): 2}


def test_c10_78_lfu_cap_order(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=IndexSettings(max_holds=3))
    env.policy(eviction="lfu")
    env.chain("r1", [h(1)], age=50)
    env.chain("r1", [h(2)], age=10)
    env.chain("r1", [h(3)], age=10)
    env.lookup([h(1)])
    env.lookup([h(1)])
    env.lookup([h(3)])
    env.chain("r1", [h(4)], age=5)  # counts: h1=2 h2=0 h3=1 h4=0 -> h2 (older than h4)
    assert {k[4] for k in env.holds()} == {h(1), h(3), h(4)}
    env.chain("r1", [h(5)], age=60)  # h4 and h5 at 0: h5 is older
    assert {k[4] for k in env.holds()} == {h(1), h(3), h(4)}
    assert env.metrics.evictions == {("lfu", "cap"): 2}


def test_c10_78_cap_full_key_tie_break(make_env: Callable[..., Env]) -> None:
    """Same count and last_seen: (tenant, model, scheme, adapter, hash, replica) decides."""
    ts = 1_700_000_000_000_000
    base = ("tb", "mb", "sb", "ab", h(2), "rb")
    for level in range(6):
        env = make_env(settings=IndexSettings(max_holds=1))
        smaller = list(base)
        smaller[level] = {0: "ta", 1: "ma", 2: "sa", 3: "aa", 4: h(1), 5: "ra"}[level]  # type: ignore[assignment]
        for fields in (base, tuple(smaller)):
            t, m, s, a, key, r = fields
            env.index.apply_update(
                Update(
                    replica_id=r,  # type: ignore[arg-type]
                    tenant_id=t,  # type: ignore[arg-type]
                    model_id=m,  # type: ignore[arg-type]
                    hash_scheme=s,  # type: ignore[arg-type]
                    adapter_id=a,  # type: ignore[arg-type]
                    timestamp_us=ts,
                    prefixes=[Prefix(prefix_hash=key, token_count=16)],  # type: ignore[arg-type]
                )
            )
        assert set(env.holds()) == {base}, level


def test_c10_78_mixed_algorithms_share_the_cap(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=IndexSettings(max_holds=2))
    env.policy("f", eviction="lfu")
    env.chain("r1", [h(1)], tenant_id="f", age=100)
    env.lookup([h(1)], tenant_id="f")
    env.chain("r1", [h(2)], age=10)  # LRU tenant: acts as count 0 although newer
    env.chain("r1", [h(3)], tenant_id="f", age=5)  # count 0, newer than the LRU hold
    assert {(k[0], k[4]) for k in env.holds()} == {("f", h(1)), ("f", h(3))}
    assert env.metrics.evictions == {("lru", "cap"): 1}


def test_c10_79_probe_holds_and_quota_edges(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=IndexSettings(max_holds=2))
    probe = Update(
        replica_id="__probe-x",
        tenant_id=PROBE_TENANT,
        model_id="m",
        hash_scheme="vllm",
        timestamp_us=1,  # very old: would be the first cap victim
        prefixes=[Prefix(prefix_hash=h(i), token_count=16) for i in range(5)],
    )
    env.index.apply_update(probe, allow_probe=True)
    env.legacy("r1", h(1), 64, age=2)
    env.legacy("r1", h(2), 64, age=1)
    assert env.metrics.evictions == {}
    env.legacy("r1", h(3), 64)
    assert env.metrics.evictions == {("lru", "cap"): 1}
    assert sum(1 for k in env.holds() if k[0] == PROBE_TENANT) == 5
    assert env.index.counts()["reserved_holds"] == 5
    # no quota: unbounded; a negative quota acts as 0
    env2 = make_env()
    for i in range(50):
        env2.legacy("r1", h(i), 64)
    assert env2.index.counts()["keys"] == 50
    env2.quota("t", -3)
    env2.stats("r1")
    assert env2.index.counts()["keys"] == 0


def test_c10_80_quota_counts_keys_and_evicts_by_newest_hold(env: Env) -> None:
    env.quota("t", 2)
    for r, age in (("r1", 100), ("r2", 1), ("r3", 50)):
        env.legacy(r, h(1), 64, age=age)  # one key on 3 replicas; newest hold 1 s old
    env.legacy("r1", h(2), 64, age=20)
    assert env.index.counts()["keys"] == 2 and env.metrics.tenant_evicted == {}
    env.legacy("r1", h(3), 64, age=0)
    assert {k[4] for k in env.holds()} == {h(1), h(3)}  # h(2) had the oldest newest hold
    assert env.metrics.tenant_evicted == {("t", "over_entries"): 1}
    assert env.metrics.evictions == {}
    env.legacy("r1", h(4), 64, age=0)  # h(1)'s newest is 1 s old: evicted with all 3 holds
    assert {k[4] for k in env.holds()} == {h(3), h(4)}
    assert env.metrics.tenant_evicted == {("t", "over_entries"): 2}


def test_c10_81_quota_zero_and_other_tenants(env: Env) -> None:
    env.quota("t", 0)
    env.legacy("r1", h(9), 64, tenant_id="other")
    for i in range(3):
        env.chain("r1", [h(i), h(i + 10)])
        assert env.index.counts()["keys"] == 1  # only the other tenant's key
    assert {k[0] for k in env.holds()} == {"other"}
    assert env.metrics.tenant_evicted == {("t", "over_entries"): 6}


def test_c10_81_quota_runs_for_stats_only_and_empty_scheme_updates(env: Env) -> None:
    for i in range(4):
        env.legacy("r1", h(i), 64, age=10 - i)
    env.quota("t", 2)
    assert env.index.counts()["keys"] == 4  # quotas apply at ingest, not at config swap
    env.update("r1", [Prefix(prefix_hash=h(9), token_count=1)], hash_scheme="")
    assert {k[4] for k in env.holds()} == {h(2), h(3)}
    env.quota("t", 1)
    env.update("r1", [], stats=Stats())
    assert {k[4] for k in env.holds()} == {h(3)}


def test_c10_82_quota_ties_use_model_scheme_adapter_hash(env: Env) -> None:
    ts = env.now
    env.quota("t", 5)
    entries = [
        ("m2", "vllm", "", h(1)),
        ("m1", "vllm", "b", h(1)),
        ("m1", "vllm", "a", h(2)),
        ("m1", "vllm", "a", h(1)),  # same hash as the previous-but-one under another adapter
        ("m1", "sglang", "z", h(9)),
        ("m1", "vllm", "a", h(3)),
    ]
    for model, scheme, adapter, key in entries:
        env.legacy(
            "r1",
            key,
            64,
            model_id=model,
            hash_scheme=scheme,
            entry_adapter=adapter,
            timestamp_us=ts,
        )
    # 6 keys (one hash under two adapters is two keys), quota 5: the smallest by
    # (model, scheme, adapter, hash) goes
    left = {(k[1], k[2], k[3], k[4]) for k in env.holds()}
    assert left == set(entries) - {("m1", "sglang", "z", h(9))}
    env.quota("t", 2)
    env.stats("r1")
    left = {(k[1], k[2], k[3], k[4]) for k in env.holds()}
    assert left == {("m1", "vllm", "b", h(1)), ("m2", "vllm", "", h(1))}
