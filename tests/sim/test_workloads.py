"""Workloads: seeded, in arrival order, shaped as documented, and big enough to evict."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from inferencecache.engines.simulated import SimCache
from inferencecache.sim.cluster import DEFAULT_ENGINE
from inferencecache.sim.workloads import (
    LORA,
    WORKLOADS,
    Request,
    WorkloadSpec,
    adapters_of,
    generate,
)


def reqs(name: str, n: int = 400, seed: int = 7, rate: float = 40.0) -> list[Request]:
    return list(generate(WorkloadSpec(name, n, rate, seed)))


def as_tuples(rs: list[Request]) -> list[tuple[object, ...]]:
    return [(r.index, r.arrival, r.tenant, r.model, r.adapter, r.tokens.tolist(), r.max_tokens,
             r.session, r.kind) for r in rs]


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_requests_other_seed_other_requests(name: str) -> None:
    a, b, c = reqs(name), reqs(name), reqs(name, seed=8)
    assert as_tuples(a) == as_tuples(b)
    assert [r.tokens.tolist() for r in a] != [r.tokens.tolist() for r in c]


@pytest.mark.parametrize("name", WORKLOADS)
def test_shape_of_every_request(name: str) -> None:
    rs = reqs(name)
    assert [r.index for r in rs] == list(range(len(rs)))
    assert all(a.arrival <= b.arrival for a, b in itertools.pairwise(rs))
    assert rs[0].arrival >= 0
    for r in rs:
        assert len(r.tokens) > 0 and all(0 <= t < 65_536 for t in r.tokens)
        assert r.max_tokens >= 1
        assert r.tenant and r.session
        assert (r.adapter == "") == (r.model == "sim-model")
        if r.adapter:
            assert r.model == r.adapter


def test_request_count_and_rate() -> None:
    rs = reqs("rag", n=2000, rate=50.0)
    assert len(rs) == 2000
    span = rs[-1].arrival - rs[0].arrival
    assert 30 < span < 50  # Poisson at 50/s: ~40 s for 2000 requests


def test_chat_turns_resend_the_whole_history() -> None:
    by_session: dict[str, list[Request]] = {}
    for r in reqs("chat", n=600):
        by_session.setdefault(r.session, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) >= 3]
    assert multi
    for turns in multi:
        for prev, nxt in itertools.pairwise(turns):
            # next prompt = previous prompt + the assistant's answer + a new user message
            assert nxt.tokens[: len(prev.tokens)] == prev.tokens
            assert len(nxt.tokens) >= len(prev.tokens) + prev.max_tokens
            assert nxt.arrival > prev.arrival
    tenants = {t[0].tenant for t in by_session.values()}
    assert len(tenants) > 1


def test_rag_questions_share_their_document() -> None:
    rs = reqs("rag", n=600)
    docs: dict[str, list[Request]] = {}
    for r in rs:
        docs.setdefault(r.session, []).append(r)
    assert 5 < len(docs) <= 32
    system = rs[0].tokens[:48]
    for group in docs.values():
        assert all(r.tokens[:48] == system for r in group)
        if len(group) > 1:
            a, b = group[0], group[1]
            common = 0
            for x, y in zip(a.tokens, b.tokens, strict=False):
                if x != y:
                    break
                common += 1
            assert common >= 48 + 512  # system prompt + at least the shortest document


def test_lora_tenants_share_one_system_prompt_under_different_adapters() -> None:
    rs = reqs("lora", n=600)
    adapters = {r.adapter for r in rs}
    assert adapters == set(LORA.adapters)
    first: dict[str, list[int]] = {}
    for r in rs:
        first.setdefault(r.adapter, r.tokens[:256].tolist())
    assert len({tuple(v) for v in first.values()}) == 1  # identical tokens, 8 adapters
    assert adapters_of(WorkloadSpec("lora")) == list(LORA.adapters)
    assert adapters_of(WorkloadSpec("chat")) == []


def test_mix_has_every_kind() -> None:
    kinds = {r.kind for r in reqs("mix", n=600)}
    assert kinds == {"chat", "rag", "lora"}
    assert adapters_of(WorkloadSpec("mix")) == list(LORA.adapters)


@pytest.mark.parametrize("name", WORKLOADS)
def test_one_engine_cache_must_evict(name: str) -> None:
    """The documented sizing: a default engine cannot hold the working set of 1000 requests."""
    cache = SimCache(DEFAULT_ENGINE.block_size, DEFAULT_ENGINE.num_blocks)
    evicted = 0
    for r in reqs(name, n=1000):
        evicted += len(cache.insert(r.tokens, r.adapter).evicted)
    assert evicted > DEFAULT_ENGINE.num_blocks


@pytest.mark.parametrize(
    ("kw", "msg"),
    [({"name": "nope"}, "unknown workload"), ({"requests": -1}, "requests"),
     ({"rate": 0.0}, "rate"), ({"rate": float("inf")}, "rate")],
)
def test_bad_specs_are_rejected(kw: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(WorkloadSpec(), **kw)
