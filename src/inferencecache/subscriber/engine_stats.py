"""vLLM's metric names and the pure stats math on them (engine-events-and-subscriber.md §7).

No I/O and no heavy imports: the subscriber's stats path reads these names, the fake engines
export them, and the simulator and the demo compute the same values from them.
"""

from __future__ import annotations

from typing import Final

KV_USAGE: Final = "vllm:kv_cache_usage_perc"
GPU_USAGE: Final = "vllm:gpu_cache_usage_perc"
CPU_USAGE: Final = "vllm:cpu_cache_usage_perc"
RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
HITS: Final = "vllm:prefix_cache_hits"
QUERIES: Final = "vllm:prefix_cache_queries"
EXT_HITS: Final = "vllm:external_prefix_cache_hits"
EXT_QUERIES: Final = "vllm:external_prefix_cache_queries"


def clamp01(x: float) -> float:
    """Clamp to [0, 1]; NaN → 0."""
    if not x > 0:
        return 0.0
    return 1.0 if x > 1 else x


def delta_hit_rate(d_hits: float, d_queries: float) -> float:
    """Hit rate between two counter readings; 0 on a counter reset or without traffic."""
    if d_hits < 0 or d_queries <= 0:
        return 0.0
    return clamp01(d_hits / d_queries)


def pressure(load: float, ceiling: int) -> float:
    """Running+waiting requests over the ceiling that counts as pressure 1, in [0, 1]."""
    if ceiling <= 0 or not load > 0:
        return 0.0
    return clamp01(load / ceiling)
