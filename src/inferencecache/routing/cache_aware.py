"""The hint-plane policy: follow LookupRoute's answer, never depend on it.

Routes on PREFIX_MATCH / TENANT_HOT / AFFINITY_HINT (contract-and-index.md §5.12) to the best-ranked
healthy replica; on anything else (NO_HINT, TIMEOUT, UNKNOWN_*, an unreachable server, no hint at
all) it falls back to round robin, so a dead hint plane costs cache hits, never requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferencecache.routing import reasons
from inferencecache.routing.basic import Rotor, check_balance, least_loaded, overloaded
from inferencecache.routing.model import Decision, Hint, RouteInput


class CacheAwarePolicy:
    """Routes on the LookupRoute hint; round robin otherwise.

    ``follow_ranked`` (default true): when the top-ranked replica is not healthy, take the next
    healthy one in the hint's ranking (it holds a shorter but real match) before falling back.
    With ``follow_ranked=False`` only the top replica is considered.

    Load guard (``balance_abs_threshold > 0``, off by default): when the hinted replica has more
    than ``balance_abs_threshold`` requests in flight above the least loaded healthy replica and
    more than ``balance_rel_threshold`` times as many (``RouteInput.load``), the least loaded one
    gets the request instead (reason ``LOAD_BALANCE``).

    Weak matches (``min_match_fraction > 0``, off by default): a PREFIX_MATCH whose chosen
    replica matched fewer than this fraction of the prompt's tokens (``Hint.matched_tokens``)
    saves too little prefill to be worth that replica's queue, so the least loaded replica gets
    it (``LOAD_BALANCE``), like SGLang's ``cache_threshold`` and approximate's
    ``match_threshold``.
    """

    name = "cache_aware"
    needs_hint = True
    needs_oracle = False

    def __init__(
        self,
        follow_ranked: bool = True,
        balance_abs_threshold: int = 0,
        balance_rel_threshold: float = 1.5,
        min_match_fraction: float = 0.0,
    ) -> None:
        check_balance(balance_abs_threshold, balance_rel_threshold)
        if not 0.0 <= min_match_fraction <= 1.0:
            raise ValueError(f"min_match_fraction must be in [0, 1], got {min_match_fraction}")
        self.min_match_fraction = min_match_fraction
        self.follow_ranked = follow_ranked
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.rotor = Rotor()
        self.routed = 0  # decisions that followed the hint
        self.fallbacks = 0  # decisions that used round robin

    def choose(self, route: RouteInput, healthy: Sequence[str]) -> Decision:
        hint = route.hint
        if hint is None:
            reason = reasons.HINT_UNAVAILABLE
        elif hint.reason_code in reasons.ROUTABLE:
            ranked = hint.replicas if self.follow_ranked else hint.replicas[:1]
            for i, replica in enumerate(ranked):
                if replica in healthy:
                    if self._weak(route, hint, i) or overloaded(
                        replica,
                        healthy,
                        route.load,
                        self.balance_abs_threshold,
                        self.balance_rel_threshold,
                    ):
                        return Decision(
                            self.rotor.pick(least_loaded(healthy, route.load)),
                            reasons.LOAD_BALANCE,
                        )
                    self.routed += 1
                    return Decision(replica, hint.reason_code)
            reason = reasons.HINTED_REPLICA_UNHEALTHY if hint.replicas else reasons.NO_HINT
        elif hint.reason_code in reasons.ALL:
            reason = hint.reason_code
        else:  # a code this version does not know: the no-hint default (contract-and-index.md §2.1)
            reason = reasons.UNRECOGNIZED
        self.fallbacks += 1
        return Decision(self.rotor.pick(healthy), reason, fallback=True)

    def _weak(self, route: RouteInput, hint: Hint, i: int) -> bool:
        """Whether ranked replica ``i`` matched too little of the prompt to be worth a queue."""
        frac = self.min_match_fraction
        if frac <= 0 or hint.reason_code != reasons.PREFIX_MATCH or not route.tokens:
            return False
        counts = hint.matched_tokens
        if i >= len(counts):
            return False
        return counts[i] < frac * len(route.tokens)

    def observe(self, route: RouteInput, replica: str) -> None:
        """The hint plane learns from engine events, not from routing decisions."""
