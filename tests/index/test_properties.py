"""Property tests: partition isolation, adapter-scoped eviction, order independence, and a
stateful machine checking the views against a recount after every step (every backend)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, cast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from inferencecache.index import (
    STORE_BACKENDS,
    Event,
    EventType,
    FakeClock,
    Index,
    IndexConfig,
    IndexSettings,
    LookupRequest,
    LookupResult,
    Prefix,
    Reason,
    Router,
    Stats,
    TenantPolicy,
    TenantQuota,
    Update,
)
from inferencecache.index.store import PartitionStore
from tests.index.support import TEST_POLICY, h

TENANTS = ["t", "u", ""]
MODELS = ["m", "n"]
SCHEMES = ["vllm", "sglang"]
ADAPTERS = ["", "a", "b"]
REPLICAS = ["r0", "r1", "r2", "r3"]
KEYS = [h(i) for i in range(6)]
NOW = 1_700_000_000_000_000

HOLD_FIELDS = st.fixed_dictionaries(
    {
        "tenant_id": st.sampled_from(TENANTS),
        "model_id": st.sampled_from(MODELS),
        "hash_scheme": st.sampled_from(SCHEMES),
        "replica_id": st.sampled_from(REPLICAS),
        "adapter_id": st.sampled_from(ADAPTERS),
        "timestamp_us": st.integers(NOW - 2_000_000_000, NOW),
    }
)
ENTRY = st.one_of(
    st.builds(
        Prefix,
        prefix_hash=st.sampled_from(KEYS),
        token_count=st.integers(-5, 200),
        tier=st.sampled_from([0, 1, 2, 7, -1]),
        adapter_id=st.sampled_from(ADAPTERS),
    ),
    st.builds(
        lambda ks, c, tier, a: Prefix(
            block_hashes=ks, block_token_counts=[c] * len(ks), tier=tier, adapter_id=a
        ),
        st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
        st.integers(1, 64),
        st.sampled_from([0, 1, 2]),
        st.sampled_from(ADAPTERS),
    ),
)
UPDATE = st.builds(
    lambda f, entries: Update(prefixes=entries, **f), HOLD_FIELDS, st.lists(ENTRY, max_size=4)
)
LOOKUP = st.builds(
    lambda t, m, s, a, chain, exact: LookupRequest(
        tenant_id=t,
        model_id=m,
        hash_scheme=s,
        adapter_id=a,
        block_hashes=chain if chain else [],
        block_token_counts=[16] * len(chain) if chain else [],
        prefix_hash=b"" if chain else exact,
    ),
    st.sampled_from(TENANTS),
    st.sampled_from(MODELS),
    st.sampled_from(SCHEMES),
    st.sampled_from(ADAPTERS),
    st.one_of(st.just([]), st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)),
    st.sampled_from(KEYS),
)
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
POLICIES = IndexConfig(policies=dict.fromkeys(TENANTS, TEST_POLICY))

Factory = Callable[[], PartitionStore]


def _index(factory: Factory, **kw: Any) -> tuple[Index, Router, FakeClock]:
    clock = FakeClock(now_us=NOW)
    index = Index(clock=clock, store_factory=factory, config=kw.pop("config", POLICIES), **kw)
    return index, Router(index), clock


def _holds(index: Index) -> set[tuple[str, str, str, str, bytes, str]]:
    st_ = index._state
    out = set()
    for part in st_.parts.values():
        for hold in part.store.holds():
            out.add((*part.key, hold.key, st_.replicas.name(hold.replica)))
    return out


def _check_result(index: Index, req: LookupRequest, res: LookupResult) -> None:
    """Consistency every answer must have (also used by the state machine)."""
    hint = res.reason_code in (Reason.PREFIX_MATCH, Reason.TENANT_HOT, Reason.AFFINITY_HINT)
    assert bool(res.replica_scores) == hint
    if res.reason_code == Reason.PREFIX_MATCH:
        first = req.block_hashes[0] if len(req.block_hashes) else req.prefix_hash
        held = _holds(index)
        part = (req.tenant_id, req.model_id, req.hash_scheme, req.adapter_id)
        for s in res.replica_scores:
            # (a) only holds of the request's own partition can produce a match
            assert (*part, first, s.replica_id) in held, (req, s)
            assert (
                s.matched_tokens == int(s.matched_tokens) and -(2**31) <= s.matched_tokens < 2**31
            )
        names = [s.replica_id for s in res.replica_scores]
        assert len(set(names)) == len(names)
        scores = [s.score for s in res.replica_scores]
        assert scores == sorted(scores, reverse=True)
    if res.reason_code == Reason.AFFINITY_HINT:
        (s,) = res.replica_scores
        assert (s.score, s.matched_tokens, s.estimated_cache_hit_prob, s.tier) == (0, 0, 0, 0)
        serving = index._state.serving.get((req.tenant_id, req.model_id, req.hash_scheme), {})
        assert s.replica_id in {index._state.replicas.name(r) for r in serving}


@SETTINGS
@given(updates=st.lists(UPDATE, max_size=12), lookups=st.lists(LOOKUP, min_size=1, max_size=8))
def test_property_a_matches_come_from_the_requests_partition(
    store_factory: Factory, updates: list[Update], lookups: list[LookupRequest]
) -> None:
    """Checked after every step of the run (the empty index, then each update), not only on
    the final state: a foreign-partition match at an intermediate state fails even when a later
    update adds the hold the check looks for to the request's own partition."""
    index, router, _ = _index(store_factory)
    for step in range(len(updates) + 1):
        if step:
            index.apply_update(updates[step - 1])
        for req in lookups:
            _check_result(index, req, router.lookup(req))
        assert index.verify() == [], f"after step {step}"


@SETTINGS
@given(
    updates=st.lists(UPDATE, max_size=12),
    fields=HOLD_FIELDS,
    key=st.sampled_from(KEYS),
)
def test_property_b_adapter_scoped_eviction(
    store_factory: Factory, updates: list[Update], fields: dict[str, Any], key: bytes
) -> None:
    index, _, _ = _index(store_factory)
    for u in updates:
        index.apply_update(u)
    before = _holds(index)
    t, m, r, a = fields["tenant_id"], fields["model_id"], fields["replica_id"], fields["adapter_id"]
    index.apply_event(
        Event(
            type=EventType.PREFIX_EVICTED,
            tenant_id=t,
            model_id=m,
            replica_id=r,
            prefix_hash=key,
            adapter_id=a,
        )
    )
    after = _holds(index)
    removed = before - after
    assert after <= before
    if a:
        assert all(x[3] == a for x in removed)  # another adapter's hold never goes
    want = {
        x
        for x in before
        if x[0] == t and x[1] == m and x[4] == key and x[5] == r and (not a or x[3] == a)
    }
    assert removed == want
    assert index.verify() == []


@SETTINGS
@given(
    updates=st.lists(UPDATE, max_size=8, unique_by=lambda u: u.replica_id),
    lookups=st.lists(LOOKUP, min_size=1, max_size=8),
    order=st.randoms(use_true_random=False),
)
def test_property_c_order_of_independent_updates(
    store_factory: Factory, updates: list[Update], lookups: list[LookupRequest], order: Any
) -> None:
    """Updates of different replicas commute: any order gives the same answers."""
    shuffled = list(updates)
    order.shuffle(shuffled)
    answers = []
    for seq in (updates, shuffled):
        index, router, _ = _index(store_factory)
        for u in seq:
            index.apply_update(u)
        answers.append(([router.lookup(r) for r in lookups], _holds(index), index.snapshot()))
    assert answers[0] == answers[1]


# ---------------------------------------------------------------------------------------------
# Stateful: random operation sequences, views recounted after every step


class IndexMachine(RuleBasedStateMachine):
    FACTORY: Factory = STORE_BACKENDS["python"]

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(now_us=NOW)
        self.index = Index(
            IndexSettings(max_holds=14, default_ttl=600),
            clock=self.clock,
            store_factory=self.FACTORY,
            config=POLICIES,
        )
        self.router = Router(self.index)

    @rule(u=UPDATE, stats=st.none() | st.floats(allow_nan=True, allow_infinity=True))
    def ingest(self, u: Update, stats: float | None) -> None:
        u.timestamp_us = self.clock.now_us() - (NOW - u.timestamp_us) // 4
        if stats is not None:
            u.stats = Stats(hit_rate=stats, pressure=stats)
        self.index.apply_update(u)
        st_ = self.index._state
        quota = st_.policies.quotas.get(u.tenant_id)
        if quota is not None:  # enforced at the end of every ingest of that tenant
            assert st_.keys_by_tenant.get(u.tenant_id, 0) <= quota

    @rule(u=UPDATE)
    def ingest_no_scheme(self, u: Update) -> None:
        u.hash_scheme = ""
        self.index.apply_update(u)

    @rule(
        f=HOLD_FIELDS,
        typ=st.sampled_from(list(EventType)),
        key=st.sampled_from(KEYS),
    )
    def event(self, f: dict[str, Any], typ: EventType, key: bytes) -> None:
        self.index.apply_event(
            Event(
                type=typ,
                tenant_id=f["tenant_id"],
                model_id=f["model_id"],
                replica_id=f["replica_id"],
                prefix_hash=key,
                adapter_id=f["adapter_id"],
            )
        )

    @rule(seconds=st.sampled_from([1.0, 60.0, 300.0, 601.0]))
    def advance_and_sweep(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.index.sweep()

    @rule(
        lfu=st.sampled_from(TENANTS),
        quota=st.none() | st.tuples(st.sampled_from(TENANTS[:2]), st.integers(-1, 6)),
        ttl=st.sampled_from([0.0, 120.0]),
    )
    def swap_config(self, lfu: str, quota: tuple[str, int] | None, ttl: float) -> None:
        pols = {t: TEST_POLICY for t in TENANTS}
        pols[lfu] = TenantPolicy(eviction="lfu", eviction_ttl=ttl, minimum_matched_tokens=0)
        quotas = {} if quota is None else {quota[0]: TenantQuota(quota[1])}
        self.index.replace_config(IndexConfig(policies=pols, quotas=quotas))

    @rule(req=LOOKUP)
    def lookup(self, req: LookupRequest) -> None:
        res = self.router.lookup(req)
        _check_result(self.index, req, res)
        if res.reason_code != Reason.NO_HINT:  # NO_HINT may be pre- or post-index
            assert res.adapter_id == req.adapter_id

    @invariant()
    def cap_holds(self) -> None:
        st_ = self.index._state
        assert st_.total_holds - st_.reserved_holds <= 14

    @invariant()
    def views_equal_recount(self) -> None:
        assert self.index.verify() == []

    def teardown(self) -> None:
        self.router.close()


for _name, _factory in STORE_BACKENDS.items():
    _cls = type(f"IndexMachine_{_name}", (IndexMachine,), {"FACTORY": staticmethod(_factory)})
    _case: Any = cast(Any, _cls).TestCase
    _case.settings = settings(
        max_examples=40,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    globals()[f"TestIndexMachine_{_name}"] = _case


def test_every_reason_is_reachable_in_the_domain() -> None:
    """Guard for the generators above: they can produce the interesting reason codes."""
    index, router, _ = _index(STORE_BACKENDS["python"])
    index.apply_update(
        Update(
            replica_id="r0",
            tenant_id="t",
            model_id="m",
            hash_scheme="vllm",
            timestamp_us=NOW,
            prefixes=[Prefix(prefix_hash=KEYS[0], token_count=64)],
            stats=Stats(hit_rate=0.5),
        )
    )
    reasons = {
        router.lookup(
            LookupRequest(tenant_id=t, model_id=m, hash_scheme=s, prefix_hash=k)
        ).reason_code
        for t, m, s, k in itertools.product(TENANTS, MODELS, SCHEMES, KEYS[:2])
    }
    assert {
        Reason.PREFIX_MATCH,
        Reason.TENANT_HOT,
        Reason.UNKNOWN_TENANT,
        Reason.UNKNOWN_MODEL,
        Reason.UNKNOWN_HASH_SCHEME,
        Reason.NO_HINT,
    } <= reasons
