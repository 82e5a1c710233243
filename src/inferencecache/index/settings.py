"""Server knobs of the index (contract-and-index.md §5.4) and this project's size bounds (§4.2).

Values are clamped the way the contract says (``DEFAULT_TTL``/``SWEEP_INTERVAL`` <= 0 take the
default, ``ENGINE_BLOCK_SIZE`` <= 0 is ignored) instead of being rejected, so a server started
with the reference's environment behaves like the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_TTL_S = 1800.0
DEFAULT_SWEEP_INTERVAL_S = 60.0
DEFAULT_BLOCK_SIZE = 16

MAX_BLOCKS_PER_ENTRY = 65_536
"""Blocks per chain ``PrefixEntry`` at ingest, and blocks per lookup chain (65,536 x 16 = the
1,048,576-token request bound)."""
MAX_ENTRIES_PER_UPDATE = 65_536
"""``PrefixEntry`` count per ``CacheStateUpdate``; entries beyond it are dropped."""
MAX_HASH_BYTES = 256
"""Length of one stored key (``prefix_hash`` or a block hash); longer entries are dropped."""
TOKENIZE_SLOTS = 64
"""Concurrent prompt_text tokenizations (non-blocking acquire; contract-and-index.md §5.2 step
4)."""
PROMPT_DEADLINE_S = 5.0
"""Deadline of a prompt_text lookup when neither the caller nor the policy sets one
(contract-and-index.md §5.1)."""


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """Server-wide knobs; durations in seconds. See docs/index.md for every bound."""

    pressure_weight: float = 1.0
    slo_tight_ttft_ms: int = 200
    slo_tight_bias: float = 1.0
    tenant_hot_min_hit_rate: float = 0.1
    tenant_hot_max_age: float = 300.0
    default_ttl: float = DEFAULT_TTL_S
    sweep_interval: float = DEFAULT_SWEEP_INTERVAL_S
    max_holds: int = 1_000_000
    max_tenants: int = 10_000
    max_replicas_per_scope: int = 4_096
    max_stats_rows: int = 100_000
    engine_block_size: int = DEFAULT_BLOCK_SIZE
    max_blocks_per_entry: int = MAX_BLOCKS_PER_ENTRY
    max_entries_per_update: int = MAX_ENTRIES_PER_UPDATE
    max_hash_bytes: int = MAX_HASH_BYTES

    def __post_init__(self) -> None:
        if not (self.default_ttl > 0 and math.isfinite(self.default_ttl)):
            object.__setattr__(self, "default_ttl", DEFAULT_TTL_S)
        if not (self.sweep_interval > 0 and math.isfinite(self.sweep_interval)):
            object.__setattr__(self, "sweep_interval", DEFAULT_SWEEP_INTERVAL_S)
        if self.engine_block_size <= 0:
            object.__setattr__(self, "engine_block_size", DEFAULT_BLOCK_SIZE)
        for name in ("max_holds", "max_tenants", "max_replicas_per_scope", "max_stats_rows"):
            if getattr(self, name) < 0:
                object.__setattr__(self, name, 0)
        for name in ("max_blocks_per_entry", "max_entries_per_update", "max_hash_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def default_ttl_us(self) -> int:
        return max(1, round(self.default_ttl * 1_000_000))

    @property
    def tenant_hot_max_age_us(self) -> int:
        """TENANT_HOT window in µs; <= 0 disables TENANT_HOT."""
        if not math.isfinite(self.tenant_hot_max_age):
            return 0 if self.tenant_hot_max_age < 0 else 2**62
        return round(self.tenant_hot_max_age * 1_000_000)
