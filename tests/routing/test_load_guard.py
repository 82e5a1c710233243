"""The load guard and weak-match rule the demo turns on (off by default): ``cache_aware`` and
``oracle`` leave an overloaded replica, ``cache_aware`` ignores a match covering too little."""

from __future__ import annotations

import pytest

from inferencecache import fingerprint
from inferencecache.routing import CacheAwarePolicy, Hint, OraclePolicy, RouteInput, make_policy
from inferencecache.routing import reasons as R
from inferencecache.routing.basic import overloaded

B = 4
HEALTHY = ["r0", "r1", "r2"]
TOKENS = list(range(10 * B))


def route(hint: Hint | None = None, oracle: dict[str, int] | None = None,
          load: dict[str, int] | None = None) -> RouteInput:
    return RouteInput("t", "m", "", TOKENS, fingerprint.chain_packed(TOKENS, B), B,
                      hint=hint, oracle=oracle, load=load)


def test_overloaded_needs_both_thresholds_and_is_off_at_zero() -> None:
    load = {"r0": 9, "r1": 2, "r2": 4}
    assert overloaded("r0", HEALTHY, load, 4, 1.5)
    assert not overloaded("r0", HEALTHY, load, 7, 1.5)  # 9 - 2 = 7 is not more than 7
    assert not overloaded("r0", HEALTHY, load, 4, 5.0)  # 9 is not more than 5 x 2
    assert not overloaded("r2", HEALTHY, load, 1, 2.0)  # 4 - 2 = 2 > 1 but 4 is not > 2 x 2
    assert not overloaded("r0", HEALTHY, load, 0, 1.5)
    assert not overloaded("r0", HEALTHY, None, 4, 1.5)
    assert not overloaded("r0", ["r0"], load, 4, 1.5)


def test_cache_aware_defaults_follow_the_hint_whatever_the_load() -> None:
    p = CacheAwarePolicy()
    hint = Hint(R.PREFIX_MATCH, ("r0",), matched_tokens=(B,))
    d = p.choose(route(hint, load={"r0": 50, "r1": 0, "r2": 0}), HEALTHY)
    assert (d.replica, d.reason, d.fallback) == ("r0", R.PREFIX_MATCH, False)


def test_cache_aware_leaves_an_overloaded_replica_for_the_least_loaded() -> None:
    p = make_policy("cache_aware", balance_abs_threshold=4)
    hint = Hint(R.PREFIX_MATCH, ("r0", "r1"), matched_tokens=(8 * B, 4 * B))
    d = p.choose(route(hint, load={"r0": 9, "r1": 3, "r2": 1}), HEALTHY)
    assert (d.replica, d.reason, d.fallback) == ("r2", R.LOAD_BALANCE, False)
    d = p.choose(route(hint, load={"r0": 5, "r1": 3, "r2": 1}), HEALTHY)
    assert (d.replica, d.reason) == ("r0", R.PREFIX_MATCH)
    aff = Hint(R.AFFINITY_HINT, ("r1",))
    d = p.choose(route(aff, load={"r0": 0, "r1": 9, "r2": 0}), HEALTHY)
    assert d.reason == R.LOAD_BALANCE and d.replica in ("r0", "r2")


def test_cache_aware_ignores_weak_matches() -> None:
    p = make_policy("cache_aware", min_match_fraction=0.3)
    weak = Hint(R.PREFIX_MATCH, ("r0",), matched_tokens=(2 * B,))  # 8 of 40 tokens
    d = p.choose(route(weak, load={"r0": 1, "r1": 0, "r2": 0}), HEALTHY)
    assert d.reason == R.LOAD_BALANCE and d.replica in ("r1", "r2")
    strong = Hint(R.PREFIX_MATCH, ("r0",), matched_tokens=(4 * B,))  # 16 of 40
    assert p.choose(route(strong, load={"r0": 1}), HEALTHY).replica == "r0"
    unknown = Hint(R.PREFIX_MATCH, ("r0",))  # no counts: nothing to judge, follow the hint
    assert p.choose(route(unknown), HEALTHY).replica == "r0"
    hot = Hint(R.TENANT_HOT, ("r0",), matched_tokens=(0,))  # only PREFIX_MATCH is judged
    assert p.choose(route(hot), HEALTHY).replica == "r0"


def test_oracle_guard() -> None:
    p = make_policy("oracle", balance_abs_threshold=4)
    view = {"r0": 8 * B, "r1": 0, "r2": 0}
    d = p.choose(route(oracle=view, load={"r0": 9, "r1": 2, "r2": 2}), HEALTHY)
    assert d.reason == R.LOAD_BALANCE and d.replica in ("r1", "r2")
    d = p.choose(route(oracle=view, load={"r0": 3, "r1": 2, "r2": 2}), HEALTHY)
    assert (d.replica, d.reason) == ("r0", R.ORACLE_PREFIX)
    assert OraclePolicy().choose(route(oracle=view, load={"r0": 99}), HEALTHY).replica == "r0"


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("cache_aware", {"balance_abs_threshold": -1}),
        ("cache_aware", {"balance_rel_threshold": 0.5}),
        ("cache_aware", {"min_match_fraction": 1.5}),
        ("oracle", {"balance_abs_threshold": -2}),
    ],
)
def test_bad_guard_parameters(name: str, params: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=name):
        make_policy(name, **params)
