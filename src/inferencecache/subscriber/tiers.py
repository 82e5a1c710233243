"""Media-aware residency (engine-events-and-subscriber.md §6): which tier an engine block is
reported at.

T1 = the engine's own KV cache (medium nil or ``GPU`` in any case, also on CPU-only builds);
T2 = any offload medium (``CPU``, ``cpu``, ``STORAGE``, ``CPU_PINNED``, ``DISK``, ``EXTERNAL``).
A block is reported at the most local medium still holding it.
"""

from __future__ import annotations

from typing import Final

from inferencecache.kvevents.events import GPU, normalize_medium
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

__all__ = ["GPU", "GPU_ONLY", "T1", "T2", "best_tier", "normalize_medium", "only", "tier_name"]

T1: Final[int] = pb.CACHE_TIER_T1
T2: Final[int] = pb.CACHE_TIER_T2

# Media sets are immutable and the GPU-only one is shared, so the common case allocates nothing.
GPU_ONLY: Final = frozenset((GPU,))
_SINGLETONS: dict[str, frozenset[str]] = {GPU: GPU_ONLY}


def only(medium: str) -> frozenset[str]:
    """The media set holding just ``medium`` (shared instances)."""
    s = _SINGLETONS.get(medium)
    if s is None:
        s = _SINGLETONS[medium] = frozenset((medium,))
    return s


def best_tier(media: frozenset[str]) -> int:
    """T1 while the GPU holds the block, else T2."""
    return T1 if GPU in media else T2


def tier_name(tier: int) -> str:
    """``"T1"``/``"T2"`` for logs and metric labels."""
    return "T1" if tier == T1 else "T2"
