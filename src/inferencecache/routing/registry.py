"""``make_policy(name, **params)``: the one way the gateway and the simulator build a policy."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Final

from inferencecache.routing.approximate import ApproximatePolicy
from inferencecache.routing.basic import RandomPolicy, RoundRobinPolicy
from inferencecache.routing.cache_aware import CacheAwarePolicy
from inferencecache.routing.model import RoutingPolicy
from inferencecache.routing.oracle import OraclePolicy

POLICIES: Final[dict[str, Callable[..., RoutingPolicy]]] = {
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "approximate": ApproximatePolicy,
    "cache_aware": CacheAwarePolicy,
    "oracle": OraclePolicy,
}
POLICY_NAMES: Final = tuple(POLICIES)
"""In the order the demo runs them: baselines, history-only, hint plane, upper bound."""

MIN_MATCH_FRACTION: Final = 0.3
"""A prefix match covering less of the prompt than this is not worth a queue (SGLang's
``cache_threshold``)."""
GUARD_SEQ_SLOTS: Final = 16
"""Sequence slots per engine the deployed load guard assumes (the demo's engines)."""


def guard_params(name: str, max_num_seqs: int = GUARD_SEQ_SLOTS) -> dict[str, Any]:
    """The load guard a deployment runs policy ``name`` with (the classes keep it off).

    Without it, longest-prefix routing piles traffic onto the one replica holding a popular
    prefix. The three prefix-aware policies leave a replica whose in-flight count exceeds the
    least loaded one's by more than a quarter of its ``max_num_seqs`` sequence slots (and by
    ``balance_rel_threshold``, 1.5x), as SGLang's cache-aware router does; ``approximate`` and
    ``cache_aware`` also ignore a match covering less than ``MIN_MATCH_FRACTION`` of the prompt.
    ``oracle`` keeps pure longest-prefix plus the guard; the baselines take nothing. The demo,
    the simulator and the gateway's defaults all come from here.
    """
    guard = {"balance_abs_threshold": max(1, max_num_seqs // 4)}
    if name == "approximate":
        return {"match_threshold": MIN_MATCH_FRACTION, **guard}
    if name == "cache_aware":
        return {"min_match_fraction": MIN_MATCH_FRACTION, **guard}
    if name == "oracle":
        return guard
    return {}


def make_policy(name: str, **params: Any) -> RoutingPolicy:
    """A fresh policy; ``ValueError`` (one line) for an unknown name, parameter or value."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r} (want one of {', '.join(POLICIES)})")
    accepted = policy_params(name)
    for key in params:
        if key not in accepted:
            want = ", ".join(accepted) or "none"
            raise ValueError(f"routing policy {name!r} has no parameter {key!r} (has: {want})")
    try:
        return factory(**params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"routing policy {name!r}: {e}") from None


def policy_params(name: str) -> dict[str, Any]:
    """Parameter name -> default of policy ``name`` (KeyError for an unknown name)."""
    sig = inspect.signature(POLICIES[name])
    return {p.name: p.default for p in sig.parameters.values()}


def parse_params(text: str, name: str) -> dict[str, Any]:
    """``"capacity_blocks=4096,seed=3"`` -> typed kwargs for policy ``name``.

    Each value takes the type of the parameter's default (int, float or a Go-style bool), so a
    flag value is checked before any request arrives. ``ValueError`` names the bad item.
    """
    from inferencecache.config import parse_go_bool

    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r} (want one of {', '.join(POLICIES)})")
    defaults = policy_params(name)
    out: dict[str, Any] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if not sep or not key:
            raise ValueError(f"item {item!r} is not name=value")
        if key not in defaults:
            want = ", ".join(defaults) or "none"
            raise ValueError(f"routing policy {name!r} has no parameter {key!r} (has: {want})")
        default = defaults[key]
        try:
            if isinstance(default, bool):
                out[key] = parse_go_bool(value)
            elif isinstance(default, int):
                out[key] = int(value)
            elif isinstance(default, float):
                out[key] = float(value)
            else:
                out[key] = value
        except ValueError:
            kind = type(default).__name__
            raise ValueError(f"item {item!r}: {value!r} is not a valid {kind}") from None
    return out
