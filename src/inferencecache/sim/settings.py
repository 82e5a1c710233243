"""Settings of ``inferencecache simulate`` and ``inferencecache demo``: one frozen dataclass per
command (flags, env fallback and checks, ``inferencecache.config``), like every other part."""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import dataclass
from typing import Any, Final

import click

from inferencecache.config import DURATION, GO_BOOL, setting
from inferencecache.engines.simulated import EngineParams
from inferencecache.sim import cluster
from inferencecache.sim.simulator import DEFAULT_SERIES_WINDOW_S
from inferencecache.sim.workloads import WORKLOADS
from inferencecache.subscriber.refresh import DEFAULT_INTERVAL
from inferencecache.subscriber.settings import DEFAULT_ADAPTER_POLL_INTERVAL

DEMO_WORKLOADS: Final = tuple(w for w in WORKLOADS if w != "lora-churn")
"""The demo's engines serve a fixed set of adapters; ``lora-churn`` (adapters loaded and
unloaded during the run) is a ``simulate`` workload only."""

DEMO_WORKLOAD: Final = "chat"
"""The demo's default workload: multi-turn chat, the most common pattern and the one where the
difference is plainest (docs/demo.md has every workload)."""
SWEEPABLE: Final = {
    "replicas": int,
    "gpu-blocks": int,
    "request-rate": float,
    "gateways": int,
    "max-num-seqs": int,
    "prefill-ms-per-token": float,
}

_E = cluster.DEFAULT_ENGINE


def _check_common(s: Any) -> None:
    try:
        cluster.parse_policies(s.policies)
    except ValueError as e:
        raise ValueError(f"--policies: {e}") from None
    try:
        cluster.parse_policy_params(s.policy_params)
    except ValueError as e:
        raise ValueError(f"--policy-params: {e}") from None
    if s.replicas < 1:
        raise ValueError(f"--replicas: must be >= 1, got {s.replicas}")
    if s.requests < 1:
        raise ValueError(f"--requests: must be >= 1, got {s.requests}")
    if not (s.request_rate > 0 and math.isfinite(s.request_rate)):
        raise ValueError(f"--request-rate: must be a positive number, got {s.request_rate}")
    if s.seed < 0:
        raise ValueError(f"--seed: must not be negative, got {s.seed}")
    if s.gateways < 1:
        raise ValueError(f"--gateways: must be >= 1, got {s.gateways}")
    try:
        EngineParams.from_flags(s)
    except ValueError as e:
        raise ValueError(f"engine flags: {e}") from None


@dataclass(frozen=True)
class EngineFlags:
    """Engine shape flags shared by ``simulate`` and ``demo`` (same names as fake-engine's)."""

    block_size: int = setting(_E.block_size, help="Tokens per block (engines, index, gateway).")
    gpu_blocks: int = setting(_E.num_blocks, help="Prefix-cache capacity of each engine, blocks.")
    max_num_seqs: int = setting(_E.max_num_seqs, help="Concurrent sequences per engine.")
    prefill_ms_per_token: float = setting(
        _E.prefill_ms_per_token, help="Prefill time per uncached prompt token (ms)."
    )
    prefill_base_ms: float = setting(_E.prefill_base_ms, help="Fixed cost of each prefill (ms).")
    decode_ms_per_token: float = setting(
        _E.decode_ms_per_token, help="Decode time per output token (ms)."
    )


@dataclass(frozen=True)
class SimulateSettings(EngineFlags):
    """Flags of ``inferencecache simulate``."""

    workload: str = setting(
        "all", help=f"Workload: {', '.join(WORKLOADS)} or all.", param=click.Choice(
            [*WORKLOADS, "all"])
    )
    policies: str = setting(",".join(cluster.DEFAULT_POLICIES), help="Policies, in order.")
    replicas: int = setting(cluster.DEFAULT_REPLICAS, help="Engines.")
    requests: int = setting(10_000, help="Requests per workload and policy.")
    request_rate: float = setting(
        cluster.DEFAULT_RATE, help="Requests per second offered to the cluster (Poisson)."
    )
    seed: int = setting(0, help="Workload seed.")
    gateways: int = setting(
        cluster.DEFAULT_GATEWAYS,
        help="Gateway replicas; requests alternate between them, each keeps its own policy "
        "state and in-flight counts.",
    )
    policy_params: str = setting(
        "", help='Per-policy parameters: "approximate:capacity_blocks=512;cache_aware:...".'
    )
    sweep: str = setting(
        "",
        help=f"Run once per value: NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}.",
        metavar="NAME=V,...",
    )
    out: str = setting("", help="Write JSON and PNG results into this directory.", metavar="DIR")
    duration: float = setting(
        0.0, param=DURATION,
        help="Simulated time of traffic per workload and policy, e.g. 2h (requests arrive at "
        "--request-rate; --requests is then ignored); 0 = --requests.",
    )
    series_window: float = setting(
        DEFAULT_SERIES_WINDOW_S, param=DURATION,
        help="Width of the per-window time series (hit rate, TTFT p90) in the JSON and PNG.",
    )
    refresh_interval: float = setting(
        DEFAULT_INTERVAL, param=DURATION,
        help="The subscribers' --refresh-interval (0 disables: holds age out after the TTL).",
    )
    adapter_poll_interval: float = setting(
        DEFAULT_ADAPTER_POLL_INTERVAL, param=DURATION,
        help="The subscribers' --adapter-poll-interval (0 disables adapter lifecycle tracking).",
    )
    default_ttl: float = setting(
        1800.0, param=DURATION, help="The server's --default-ttl (hold TTL).",
    )

    def __post_init__(self) -> None:
        _check_common(self)
        for flag, v in (("--duration", self.duration),
                        ("--refresh-interval", self.refresh_interval),
                        ("--adapter-poll-interval", self.adapter_poll_interval)):
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{flag}: must be >= 0, got {v}")
        for flag, v in (("--series-window", self.series_window),
                        ("--default-ttl", self.default_ttl)):
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag}: must be > 0, got {v}")
        if self.sweep:
            try:
                parse_sweep(self.sweep)
            except ValueError as e:
                raise ValueError(f"--sweep: {e}") from None

    @property
    def engine(self) -> EngineParams:
        return EngineParams.from_flags(self)


def parse_sweep(text: str) -> tuple[str, list[int | float]]:
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in SWEEPABLE:
        raise ValueError(f"want NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}")
    kind = SWEEPABLE[name]
    out: list[int | float] = []
    for raw in values.split(","):
        if raw.strip():
            try:
                out.append(kind(raw.strip()))
            except ValueError:
                raise ValueError(f"{raw.strip()!r} is not a valid {kind.__name__}") from None
    if not out:
        raise ValueError("no values")
    return name, out


@dataclass(frozen=True)
class DemoSettings(EngineFlags):
    """Flags of ``inferencecache demo``."""

    workload: str = setting(
        DEMO_WORKLOAD, help=f"Workload: {', '.join(DEMO_WORKLOADS)}.",
        param=click.Choice(DEMO_WORKLOADS),
    )
    policies: str = setting(",".join(cluster.DEFAULT_POLICIES), help="Policies, in order.")
    replicas: int = setting(cluster.DEFAULT_REPLICAS, help="Engines (each with a subscriber).")
    gateways: int = setting(
        cluster.DEFAULT_GATEWAYS,
        help="Gateway processes per policy; requests alternate between them.",
    )
    requests: int = setting(400, help="Requests per policy.")
    request_rate: float = setting(
        cluster.DEFAULT_RATE, help="Requests per second offered to the cluster (Poisson)."
    )
    duration: float = setting(
        0.0, help="Seconds of traffic per policy (0 = until --requests are sent)."
    )
    seed: int = setting(0, help="Workload seed.")
    policy_params: str = setting(
        "", help='Per-policy parameters: "approximate:capacity_blocks=512;cache_aware:...".'
    )
    out: str = setting("demo-out", help="Directory for results.json and results.png.",
                       metavar="DIR")
    event_log: bool = setting(
        False, param=GO_BOOL,
        help="Run the server on the shared event log of a private redis-server (needs "
        "redis-server on PATH) and add cache_aware answered by an in-process replica in the "
        "gateway (no gRPC hop), to compare both hint overheads (docs/event-log.md).",
    )

    def __post_init__(self) -> None:
        _check_common(self)
        if self.event_log and shutil.which("redis-server") is None:
            raise ValueError("--event-log: redis-server is not installed "
                             "(apt-get install -y redis-server)")
        if not (self.duration >= 0 and math.isfinite(self.duration)):
            raise ValueError(f"--duration: must be >= 0, got {self.duration}")
        if not self.out:
            raise ValueError("--out: must not be empty")


def with_value(s: SimulateSettings, name: str, value: int | float) -> SimulateSettings:
    """``s`` with one sweepable flag replaced."""
    changes: dict[str, Any] = {name.replace("-", "_"): value}
    return dataclasses.replace(s, **changes)
