"""The same LookupRoute request in every input form gives the same answer and the same LFU credit:
block hashes as a list or packed ``bytes``, counts as a list, one-byte ``bytes`` (the server's wire
form) or ``array('i')``. The packed form under a plain policy takes ``Router.lookup``'s chain fast
path; the list form goes through contract-and-index.md §5.1 steps 2-8 in full, so this pins the fast
path to the general one (every backend, compiled ranker or twin as configured).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache.index import (
    FakeClock,
    Index,
    IndexConfig,
    LookupRequest,
    LookupResult,
    Router,
    Stats,
    TenantPolicy,
    Update,
)
from inferencecache.index.store import PartitionStore
from inferencecache.index.tenant_config import Strategy
from tests.index.test_properties import KEYS, NOW, UPDATE

POLICY = st.builds(
    TenantPolicy,
    eviction=st.sampled_from(["lru", "lfu"]),
    minimum_prefix_tokens=st.sampled_from([0, 0, 32, 100]),
    minimum_matched_tokens=st.sampled_from([0, 16, 64]),
    routing_floor_score=st.sampled_from([0.0, 0.1, 5.0]),
    lookup_timeout_ms=st.sampled_from([0, 0, 50]),
    affinity_routing=st.booleans(),
    strategy=st.builds(
        Strategy,
        enable_chain_matching=st.just(True) | st.booleans(),
        require_chain=st.booleans(),
    ),
)
STATS = st.builds(
    lambda r, p: Update(
        replica_id=r, tenant_id="t", model_id="m", hash_scheme="vllm", timestamp_us=NOW,
        stats=Stats(hit_rate=0.5, pressure=p),
    ),
    st.sampled_from(["r0", "r1", "r2"]),
    st.sampled_from([0.0, 0.25, 0.5, 1.0]),
)  # fmt: skip
CHAIN = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6)
COUNT = st.sampled_from([1, 16, 64, 127])


def _twin(factory: Callable[[], PartitionStore], policy: TenantPolicy) -> tuple[Index, Router]:
    config = IndexConfig(policies={"t": policy})
    index = Index(clock=FakeClock(now_us=NOW), store_factory=factory, config=config)
    return index, Router(index)


def _access(index: Index) -> set[tuple[Any, ...]]:
    st_ = index._state
    return {
        (*part.key, hold.key, hold.replica, hold.access)
        for part in st_.parts.values()
        for hold in part.store.holds()
    }


def _same(a: LookupResult, b: LookupResult) -> None:
    assert (a.reason_code, a.adapter_id, list(a.token_ids)) == (
        b.reason_code,
        b.adapter_id,
        list(b.token_ids),
    )
    assert a.replica_scores == b.replica_scores


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    policy=POLICY,
    updates=st.lists(UPDATE, max_size=10),
    stats=st.lists(STATS, max_size=3),
    lookups=st.lists(
        st.tuples(CHAIN, COUNT, st.sampled_from(["", "a"]), st.sampled_from([0, 100])),
        min_size=1,
        max_size=6,
    ),
)
def test_every_input_form_answers_alike(
    store_factory: Callable[[], PartitionStore],
    policy: TenantPolicy,
    updates: list[Update],
    stats: list[Update],
    lookups: list[tuple[list[bytes], int, str, int]],
) -> None:
    a, router_a = _twin(store_factory, policy)
    b, router_b = _twin(store_factory, policy)
    for u in [*updates, *stats]:
        a.apply_update(u)
        b.apply_update(u)
    for i, (chain, count, adapter, ttft) in enumerate(lookups):
        base: dict[str, Any] = {"tenant_id": "t", "model_id": "m", "hash_scheme": "vllm",
                                "adapter_id": adapter, "ttft_ms": ttft}  # fmt: skip
        counts: list[Any] = [
            [count] * len(chain),
            bytes([count]) * len(chain),
            array("i", [count] * len(chain)),
        ]
        packed = LookupRequest(
            block_hashes=b"".join(chain),
            packed_hashes=True,
            block_token_counts=counts[i % 3],
            **base,
        )
        listed = LookupRequest(block_hashes=list(chain), block_token_counts=counts[0], **base)
        _same(router_a.lookup(packed), router_b.lookup(listed))
        assert _access(a) == _access(b)
