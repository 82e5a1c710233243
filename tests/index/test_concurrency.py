"""Atomicity under threads: no lookup observes half an update, event, sweep or config swap."""

from __future__ import annotations

import threading
from collections.abc import Callable

from inferencecache.index import (
    EventType,
    IndexConfig,
    Prefix,
    Reason,
    TenantPolicy,
    TenantQuota,
)
from tests.index.support import TEST_POLICY, Env, h

N = 64


def test_chain_updates_are_atomic_to_lookups(make_env: Callable[..., Env]) -> None:
    env = make_env()
    chain = [h(i) for i in range(N)]
    stop = threading.Event()
    errors: list[str] = []
    seen = {"match": 0, "lookups": 0}

    def reader() -> None:
        while not stop.is_set():
            res = env.lookup(chain)
            seen["lookups"] += 1
            for s in res.replica_scores:
                if s.matched_tokens != 16 * N:
                    errors.append(f"{s.replica_id} saw {s.matched_tokens} tokens")
            if res.reason_code == Reason.PREFIX_MATCH:
                seen["match"] += 1

    def churn() -> None:
        # clears race the writer: a replica is either fully there or fully gone
        while not stop.is_set():
            for r in range(8):
                env.event(EventType.ALL_CLEARED, f"r{r}")
            env.index.sweep()
            env.index.replace_config(IndexConfig(policies={"t": TEST_POLICY}))

    threads = [threading.Thread(target=reader) for _ in range(3)] + [threading.Thread(target=churn)]
    for t in threads:
        t.start()
    try:
        for i in range(300):
            env.chain(f"r{i % 8}", chain)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:5]
    assert seen["lookups"] > 0
    env.check()


def test_quota_and_cap_trims_are_atomic_to_lookups(make_env: Callable[..., Env]) -> None:
    """A tenant with quota N sees, at any time, N keys at most: the update and its trim are one
    step."""
    env = make_env()
    env.index.replace_config(
        IndexConfig(
            policies={"t": TenantPolicy(minimum_matched_tokens=0, routing_floor_score=0)},
            quotas={"t": TenantQuota(4)},
        )
    )
    stop = threading.Event()
    over: list[int] = []

    def reader() -> None:
        st = env.index._state
        while not stop.is_set():
            with env.index._lock:
                n = st.keys_by_tenant.get("t", 0)
            if n > 4:
                over.append(n)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(200):
            env.update("r1", [Prefix(prefix_hash=h(i * 8 + j), token_count=16) for j in range(8)])
    finally:
        stop.set()
        t.join(30)
    assert over == []
    assert env.index.counts()["keys"] == 4
    env.check()
