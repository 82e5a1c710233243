"""The fuzz harnesses (fuzz/) work without atheris: each one's ``check`` passes on its seeds and
on derandomized hypothesis mutations of them, against the normal build. The real campaign runs
under ASan+UBSan in ``scripts/fuzz`` (``scripts/check`` runs it briefly)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz import HARNESSES


@pytest.mark.parametrize("name", HARNESSES)
def test_seeds_pass(name: str) -> None:
    harness = importlib.import_module(f"fuzz.{name}")
    seeds = harness.seeds()
    assert len(seeds) >= 3
    for seed in seeds:
        harness.check(seed)


@st.composite
def mutated(draw: st.DrawFn, name: str) -> bytes:
    seeds = importlib.import_module(f"fuzz.{name}").seeds()
    buf = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        pos = draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif buf:
            del buf[pos : pos + draw(st.integers(1, 4))]
    return bytes(buf)


@pytest.mark.parametrize("name", HARNESSES)
def test_mutated_seeds_pass(name: str) -> None:
    harness = importlib.import_module(f"fuzz.{name}")

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mutated(name))
    def run(data: bytes) -> None:
        harness.check(data)

    run()


def test_the_engine_frames_harness_catches_a_disagreement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A harness that cannot fail finds nothing: skew the fast decoder, the check fails."""
    from inferencecache.kvevents import decode

    harness = importlib.import_module("fuzz.engine_frames")
    real = decode._from_typed

    def skewed(batch: Any, payload: bytes) -> Any:
        out = real(batch, payload)
        out.ts += 1.0
        return out

    monkeypatch.setattr(decode, "_from_typed", skewed)
    failures = 0
    for seed in harness.seeds():
        try:
            harness.check(seed)
        except AssertionError:
            failures += 1
    assert failures >= 10  # every valid fixture the fast path decodes


def test_a_nan_in_stats_read_alike_is_agreement() -> None:
    """The campaign's first findings were the harness's own: NaN != NaN made two identical
    readings of a stats row with a NaN hit rate look different."""
    from fuzz import cache_state_update
    from inferencecache.v1alpha1 import inferencecache_pb2 as pb

    msg = pb.CacheStateUpdate(stats=pb.ReplicaStats(hit_rate=float("nan")))
    cache_state_update.check(msg.SerializeToString())
