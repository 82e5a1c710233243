"""The cluster both ``demo`` and ``simulate`` measure by default, and the policies' parameters.

One place, so the demo (real processes) and the simulator (simulated time) run the same
engines, workloads and policy settings and their tables can be compared line by line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from inferencecache.engines.simulated import (
    EngineParams,
)
from inferencecache.routing.registry import POLICY_NAMES, guard_params, parse_params

DEFAULT_REPLICAS: Final = 8
DEFAULT_GATEWAYS: Final = 2  # gateway replicas (an HA deployment runs at least two)
DEFAULT_RATE: Final = 40.0  # requests per second offered to the whole cluster
DEFAULT_ENGINE: Final = EngineParams(
    block_size=32,  # vLLM's CPU build's block size; half the KV events of 16 for the same tokens
    num_blocks=128,  # 4096 tokens per replica
)
DEFAULT_POLICIES: Final = POLICY_NAMES
MODEL: Final = "sim-model"
TENANT: Final = "default"
STATS_INTERVAL_S: Final = 1.0  # the demo's subscribers scrape engine metrics every second


def max_concurrency_ceiling(engine: EngineParams) -> int:
    """The subscribers' pressure denominator: a replica is fully pressed at ``max_num_seqs``."""
    return engine.max_num_seqs


def default_policy_params(engine: EngineParams) -> dict[str, dict[str, Any]]:
    """Policy parameters the comparison uses unless overridden.

    ``approximate`` gets the engines' real cache size (a fair baseline: an operator sizes a
    history router's tree to the engines' caches). The three prefix-aware policies get the load
    guard of ``routing.registry.guard_params`` for the engines' sequence slots (the gateway's
    defaults are the same guard).
    """
    seqs = engine.max_num_seqs
    return {
        "approximate": {
            "capacity_blocks": max(1, engine.num_blocks),
            **guard_params("approximate", seqs),
        },
        "cache_aware": guard_params("cache_aware", seqs),
        "oracle": guard_params("oracle", seqs),
    }


def parse_policy_params(text: str) -> dict[str, dict[str, Any]]:
    """``"approximate:capacity_blocks=512,balance_abs_threshold=4;cache_aware:follow_ranked=0"``.

    Policies separated by ``;``, each ``name:k=v,...``; ValueError names the bad part.
    """
    out: dict[str, dict[str, Any]] = {}
    for raw in text.split(";"):
        item = raw.strip()
        if not item:
            continue
        name, sep, params = item.partition(":")
        name = name.strip()
        if not sep:
            raise ValueError(f"{item!r} is not policy:k=v,...")
        out[name] = parse_params(params, name)
    return out


def merged_params(
    engine: EngineParams, overrides: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Defaults for ``engine`` with ``overrides`` applied per policy."""
    params = default_policy_params(engine)
    for name, kv in overrides.items():
        params.setdefault(name, {}).update(kv)
    return params


def format_params(params: Mapping[str, Any]) -> str:
    """``k=v,...`` as the gateway's ``--routing-params`` reads it (bools as Go booleans)."""
    parts = []
    for k, v in params.items():
        parts.append(f"{k}={str(v).lower() if isinstance(v, bool) else v}")
    return ",".join(parts)


def parse_policies(text: str) -> list[str]:
    """``"round_robin,cache_aware"`` -> names, checked and de-duplicated in order."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICY_NAMES)})")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("no policy given")
    return names
