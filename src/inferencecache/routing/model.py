"""What a routing policy sees and returns. Pure data: no sockets, no clocks, no asyncio.

A caller (gateway or simulator) tokenizes the request, fingerprints it, asks the hint plane when
the policy wants a hint (``needs_hint``), asks the engines' caches when it wants the oracle view
(``needs_oracle``), then calls ``choose`` and, once the request was dispatched, ``observe``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class Hint:
    """A LookupRoute answer: reason code and replica ids ranked best-first (may be empty)."""

    reason_code: str
    replicas: tuple[str, ...] = ()
    latency_s: float = 0.0
    # matched_tokens of each ranked replica, same order (empty when the caller does not know)
    matched_tokens: tuple[int, ...] = ()


@dataclass(slots=True)
class RouteInput:
    """One request as a policy sees it."""

    tenant_id: str
    model_id: str
    adapter_id: str
    tokens: Sequence[int]  # prompt token ids, exactly as the engine will see them
    chain: bytes  # packed 8-byte fingerprint chain of the prompt's full blocks
    block_size: int
    hint: Hint | None = None  # set for needs_hint policies; None if the hint plane failed
    oracle: Mapping[str, int] | None = None  # replica -> cached prefix tokens (needs_oracle)
    # replica -> requests in flight there (the caller's own count; None when unknown). Used only
    # to break ties and by load guards, never required.
    load: Mapping[str, int] | None = None


@dataclass(slots=True, frozen=True)
class Decision:
    """Where to send the request and why (the gateway's X-Cache-Route-Reason header)."""

    replica: str
    reason: str
    # True when the policy could not follow its own signal (no/failed hint, no oracle view)
    # and used its round-robin fallback; the gateway reports it as X-Cache-Route-Fallback.
    fallback: bool = False


class RoutingPolicy(Protocol):
    """A routing policy. ``healthy`` is non-empty and sorted; the choice must be one of them."""

    name: str
    needs_hint: bool
    needs_oracle: bool

    def choose(self, route: RouteInput, healthy: Sequence[str]) -> Decision: ...

    def observe(self, route: RouteInput, replica: str) -> None:
        """Called after the request was dispatched to ``replica`` (history-based policies learn)."""
        ...
