"""Per-producer state bounds (issue 15 item 4, ``index/bounds.py``): tenants, replicas per
(tenant, model) and stats rows beyond their caps are refused and counted, existing state keeps
answering, and a freed slot is usable again; for updates and for ICB1 batches (the server's
ingest path, the compiled applier when built) on every store backend."""

from __future__ import annotations

from collections.abc import Callable

from inferencecache.index import batch
from inferencecache.index.bounds import DROP_REPLICA_CAP, DROP_STATS_CAP, DROP_TENANT_CAP
from inferencecache.index.model import PROBE_TENANT, EventType
from inferencecache.index.model import Stats as IStats
from inferencecache.index.settings import IndexSettings
from tests.index.support import Env, h, ids

CAPS = IndexSettings(max_tenants=2, max_replicas_per_scope=2, max_stats_rows=3)


def test_new_tenants_beyond_the_cap_are_refused(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=CAPS, defaults=True)
    env.chain("r1", [h(1), h(2)], tenant_id="a")
    env.chain("r1", [h(1), h(2)], tenant_id="b")
    env.chain("r1", [h(1), h(2)], tenant_id="c")  # a third tenant
    env.stats("r1", tenant_id="d")  # stats only: a tenant too
    assert env.metrics.dropped[DROP_TENANT_CAP] == 1 + 1  # one entry, one stats row
    assert ids(env.lookup([h(1), h(2)], tenant_id="a")) == ["r1"]
    assert ids(env.lookup([h(1), h(2)], tenant_id="c")) == []
    env.chain("r2", [h(3)], tenant_id="a")  # known tenants still take updates
    assert ids(env.lookup([h(3)], tenant_id="a")) == ["r2"]
    env.chain("r1", [h(9)], tenant_id=PROBE_TENANT)  # the probe tenant is exempt
    # a tenant whose state is gone frees its slot
    env.event(int(EventType.ALL_CLEARED), "r1", tenant_id="b")
    env.chain("r1", [h(1)], tenant_id="c")
    assert ids(env.lookup([h(1)], tenant_id="c")) == ["r1"]
    assert env.index.verify() == []


def test_new_replicas_per_scope_beyond_the_cap_are_refused(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=CAPS, defaults=True)
    env.chain("r1", [h(1)])
    env.chain("r2", [h(1)], hash_scheme="sgl")  # another scheme: the same (tenant, model)
    env.chain("r3", [h(1)])
    env.stats("r4")
    assert env.metrics.dropped[DROP_REPLICA_CAP] == 1 + 1
    assert sorted(ids(env.lookup([h(1)]))) == ["r1"]
    env.chain("r3", [h(1)], model_id="other")  # another model is another scope
    assert ids(env.lookup([h(1)], model_id="other")) == ["r3"]
    env.chain("r1", [h(2)])  # a known replica keeps reporting
    assert ids(env.lookup([h(1), h(2)])) == ["r1"]


def test_stats_rows_beyond_the_cap_are_refused_and_updates_of_rows_kept(
    make_env: Callable[..., Env],
) -> None:
    env = make_env(settings=IndexSettings(max_stats_rows=2), defaults=True)
    env.stats("r1", hit_rate=0.1)
    env.stats("r2", hit_rate=0.2)
    env.stats("r3", hit_rate=0.3)
    assert env.metrics.dropped[DROP_STATS_CAP] == 1
    env.stats("r1", hit_rate=0.9)  # an existing row is updated, not refused
    rows = {s.replica_id: s.hit_rate for s in env.index.stats_rows()}
    assert set(rows) == {"r1", "r2"} and abs(rows["r1"] - 0.9) < 1e-6
    assert env.metrics.dropped[DROP_STATS_CAP] == 1


def test_zero_means_unbounded(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=IndexSettings(max_tenants=0, max_replicas_per_scope=0,
                                          max_stats_rows=0), defaults=True)  # fmt: skip
    for i in range(50):
        env.chain(f"r{i}", [h(1)], tenant_id=f"t{i % 25}")
        env.stats(f"r{i}", tenant_id=f"t{i % 25}")
    assert not env.metrics.dropped
    assert len(env.index.stats_rows()) == 50


def test_batches_obey_the_same_caps(make_env: Callable[..., Env]) -> None:
    """The ICB1 path (what ReportCacheState's parser produces; compiled when built) refuses
    exactly what the update path refuses."""
    env = make_env(settings=CAPS, defaults=True)

    def store(tenant: str, replica: str, key: int) -> batch.Record:
        return batch.Record(batch.STORE, batch.Route(tenant, "m", "vllm", "", replica), 0, 1,
                            h(key)[:8], [16])  # fmt: skip

    env.index.apply_batch(batch.encode([store("a", "r1", 1), store("b", "r1", 1),
                                        store("c", "r1", 1)]))  # fmt: skip
    env.index.apply_batch(batch.encode([store("a", "r2", 1), store("a", "r3", 1)]))
    stats = batch.Record(batch.STATS, batch.Route("z", "m", "vllm", "", "r9"), 0,
                         stats=IStats(1, 0.5, 0.1, 0, 0))  # fmt: skip
    env.index.apply_batch(batch.encode([stats]))
    assert env.metrics.dropped[DROP_TENANT_CAP] == 1 + 1
    assert env.metrics.dropped[DROP_REPLICA_CAP] == 1
    holds = env.holds()
    assert {(k[0], k[5]) for k in holds} == {("a", "r1"), ("b", "r1"), ("a", "r2")}
    assert env.index.verify() == []
