"""Policies that ignore cache state: round robin and seeded random, plus the shared tie-breaks.

They are the baselines of the demo and the fallbacks of the cache-aware and oracle policies.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from inferencecache.routing import reasons
from inferencecache.routing.model import Decision, RouteInput


class Rotor:
    """A round-robin cursor over whatever (sorted) candidate list it is handed each time."""

    __slots__ = ("position",)

    def __init__(self) -> None:
        self.position = 0

    def pick(self, candidates: Sequence[str]) -> str:
        choice = candidates[self.position % len(candidates)]
        self.position += 1
        return choice


def least_loaded(candidates: Sequence[str], load: Mapping[str, int] | None) -> list[str]:
    """The candidates with the fewest requests in flight (all of them when load is unknown)."""
    if not load or len(candidates) < 2:
        return list(candidates)
    best = min(load.get(r, 0) for r in candidates)
    return [r for r in candidates if load.get(r, 0) == best]


def overloaded(
    replica: str,
    healthy: Sequence[str],
    load: Mapping[str, int] | None,
    abs_threshold: int,
    rel_threshold: float,
) -> bool:
    """Whether ``replica`` has more than ``abs_threshold`` requests in flight above the least
    loaded healthy replica and more than ``rel_threshold`` times its count (threshold 0: off).

    The load guard of the cache-aware and oracle policies: a cached prefix is worth a short
    queue, not a long one (SGLang's cache-aware router has the same two thresholds).
    """
    if not load or abs_threshold <= 0 or len(healthy) < 2:
        return False
    low = min(load.get(r, 0) for r in healthy)
    mine = load.get(replica, 0)
    return mine - low > abs_threshold and mine > rel_threshold * low


def check_balance(abs_threshold: int, rel_threshold: float) -> None:
    """ValueError for guard thresholds out of range."""
    if abs_threshold < 0:
        raise ValueError(f"balance_abs_threshold must be >= 0, got {abs_threshold}")
    if rel_threshold < 1.0:
        raise ValueError(f"balance_rel_threshold must be >= 1, got {rel_threshold}")


class RoundRobinPolicy:
    """Each request to the next healthy replica in turn."""

    name = "round_robin"
    needs_hint = False
    needs_oracle = False

    def __init__(self) -> None:
        self.rotor = Rotor()

    def choose(self, route: RouteInput, healthy: Sequence[str]) -> Decision:
        return Decision(self.rotor.pick(healthy), reasons.ROUND_ROBIN)

    def observe(self, route: RouteInput, replica: str) -> None:
        """Round robin learns nothing."""


class RandomPolicy:
    """A uniformly random healthy replica; seeded so a simulation run is reproducible."""

    name = "random"
    needs_hint = False
    needs_oracle = False

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def choose(self, route: RouteInput, healthy: Sequence[str]) -> Decision:
        return Decision(healthy[self._rng.randrange(len(healthy))], reasons.RANDOM)

    def observe(self, route: RouteInput, replica: str) -> None:
        """Random learns nothing."""
