"""Reason strings a routing decision carries (the gateway's ``X-Cache-Route-Reason`` header).

LookupRoute's own codes (contract-and-index.md §5.12) pass through unchanged; the rest name what a
policy did or why the hint plane gave nothing usable. All are upper-case ASCII, stable, and few, so
they are safe as metric label values.
"""

from __future__ import annotations

from typing import Final

# LookupRoute reason codes (contract-and-index.md §5.12).
PREFIX_MATCH: Final = "PREFIX_MATCH"
TENANT_HOT: Final = "TENANT_HOT"
AFFINITY_HINT: Final = "AFFINITY_HINT"
NO_HINT: Final = "NO_HINT"
TIMEOUT: Final = "TIMEOUT"
POLICY_REQUIRES_CHAIN: Final = "POLICY_REQUIRES_CHAIN"
UNKNOWN_TENANT: Final = "UNKNOWN_TENANT"
UNKNOWN_MODEL: Final = "UNKNOWN_MODEL"
UNKNOWN_HASH_SCHEME: Final = "UNKNOWN_HASH_SCHEME"

SERVER_CODES: Final = frozenset(
    {
        PREFIX_MATCH,
        TENANT_HOT,
        AFFINITY_HINT,
        NO_HINT,
        TIMEOUT,
        POLICY_REQUIRES_CHAIN,
        UNKNOWN_TENANT,
        UNKNOWN_MODEL,
        UNKNOWN_HASH_SCHEME,
    }
)
ROUTABLE: Final = frozenset({PREFIX_MATCH, TENANT_HOT, AFFINITY_HINT})
"""Codes a gateway routes on (contract-and-index.md §5.12: AFFINITY_HINT is routed like
PREFIX_MATCH)."""
UNKNOWN_CODES: Final = frozenset({UNKNOWN_TENANT, UNKNOWN_MODEL, UNKNOWN_HASH_SCHEME})
"""Codes that mean a configuration mismatch (log it, fail open)."""

# Hint-plane outcomes the caller reports instead of a server code (Hint.reason_code).
HINT_UNAVAILABLE: Final = "HINT_UNAVAILABLE"  # no hint at all (RouteInput.hint is None)
HINT_TIMEOUT: Final = "HINT_TIMEOUT"  # the caller's LookupRoute deadline passed
HINT_ERROR: Final = "HINT_ERROR"  # the RPC failed (server down, bad answer, ...)
HINT_SKIPPED: Final = "HINT_SKIPPED"  # not asked: no full block, no tokenizer, ...
HINTED_REPLICA_UNHEALTHY: Final = "HINTED_REPLICA_UNHEALTHY"  # no ranked replica is healthy
UNRECOGNIZED: Final = "UNRECOGNIZED"  # a code this version does not know (fail open)

# What the history/oracle/load policies did.
ROUND_ROBIN: Final = "ROUND_ROBIN"
RANDOM: Final = "RANDOM"
APPROX_PREFIX: Final = "APPROX_PREFIX"  # longest remembered prefix
APPROX_NEW: Final = "APPROX_NEW"  # nothing remembered: least loaded / least recently chosen
APPROX_BALANCE: Final = "APPROX_BALANCE"  # load imbalance guard overrode the prefix
ORACLE_PREFIX: Final = "ORACLE_PREFIX"  # longest true cached prefix
ORACLE_NO_MATCH: Final = "ORACLE_NO_MATCH"  # no engine holds a block: load, then round robin
ORACLE_UNAVAILABLE: Final = "ORACLE_UNAVAILABLE"  # no oracle view: round robin
LOAD_BALANCE: Final = "LOAD_BALANCE"  # the signal's replica was overloaded: least loaded instead

ALL: Final = frozenset(
    SERVER_CODES
    | {
        HINT_UNAVAILABLE,
        HINT_TIMEOUT,
        HINT_ERROR,
        HINT_SKIPPED,
        HINTED_REPLICA_UNHEALTHY,
        UNRECOGNIZED,
        ROUND_ROBIN,
        RANDOM,
        APPROX_PREFIX,
        APPROX_NEW,
        APPROX_BALANCE,
        ORACLE_PREFIX,
        ORACLE_NO_MATCH,
        ORACLE_UNAVAILABLE,
        LOAD_BALANCE,
    }
)
"""Every reason a policy of this package can return (bounded metric label set)."""
