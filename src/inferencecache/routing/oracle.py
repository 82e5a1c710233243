"""The upper bound: perfect knowledge of every engine's cache (``RouteInput.oracle``).

The longest true cached prefix wins; ties (including "nobody holds anything") go to the least
loaded replica, then round robin. Without an oracle view it is plain round robin. The same load
guard as ``cache_aware`` (``balance_abs_threshold``, off by default) moves a request from an
overloaded best replica to the least loaded one (``LOAD_BALANCE``).
"""

from __future__ import annotations

from collections.abc import Sequence

from inferencecache.routing import reasons
from inferencecache.routing.basic import Rotor, check_balance, least_loaded, overloaded
from inferencecache.routing.model import Decision, RouteInput


class OraclePolicy:
    """Longest cached prefix per the engines themselves; load then round robin on ties."""

    name = "oracle"
    needs_hint = False
    needs_oracle = True

    def __init__(
        self, balance_abs_threshold: int = 0, balance_rel_threshold: float = 1.5
    ) -> None:
        check_balance(balance_abs_threshold, balance_rel_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.rotor = Rotor()  # ties
        self.fallback_rotor = Rotor()  # no oracle view

    def choose(self, route: RouteInput, healthy: Sequence[str]) -> Decision:
        oracle = route.oracle
        if oracle is None:
            return Decision(
                self.fallback_rotor.pick(healthy), reasons.ORACLE_UNAVAILABLE, fallback=True
            )
        best = max(oracle.get(r, 0) for r in healthy)
        candidates = [r for r in healthy if oracle.get(r, 0) == best]
        candidates = least_loaded(candidates, route.load)
        if overloaded(
            candidates[0], healthy, route.load, self.balance_abs_threshold,
            self.balance_rel_threshold,
        ):
            return Decision(self.rotor.pick(least_loaded(healthy, route.load)),
                            reasons.LOAD_BALANCE)
        replica = self.rotor.pick(candidates) if len(candidates) > 1 else candidates[0]
        return Decision(replica, reasons.ORACLE_PREFIX if best > 0 else reasons.ORACLE_NO_MATCH)

    def observe(self, route: RouteInput, replica: str) -> None:
        """The oracle reads the engines each time; nothing to remember."""
