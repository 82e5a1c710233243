"""Plain input/output shapes of the index, free of gRPC and protobuf.

Inputs are Protocols whose attribute names equal the v1alpha1 message fields, so the server can
hand generated protobuf messages straight in (no copy per prefix entry) while tests pass the
small dataclasses below. Outputs are dataclasses the server translates back to protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple, Protocol

PROBE_TENANT = "inferencecache.io/probe"
"""Reserved tenant of the self-test probe: acked, never indexed visibly
(contract-and-index.md §2.5)."""

MAX_TOKENS = 1_048_576
"""Upper bound on request tokens (token_ids, tokenizer output) and prompt_text UTF-8 bytes."""


class Tier(IntEnum):
    UNSPECIFIED = 0
    T1 = 1
    T2 = 2
    T3 = 3


class EventType(IntEnum):
    TYPE_UNSPECIFIED = 0
    PREFIX_ADDED = 1
    PREFIX_EVICTED = 2
    REPLICA_UPDATED = 3
    ALL_CLEARED = 4


class Reason:
    """LookupRoute reason codes (a string on the wire, contract-and-index.md §5.12)."""

    PREFIX_MATCH = "PREFIX_MATCH"
    TENANT_HOT = "TENANT_HOT"
    AFFINITY_HINT = "AFFINITY_HINT"
    NO_HINT = "NO_HINT"
    POLICY_REQUIRES_CHAIN = "POLICY_REQUIRES_CHAIN"
    TIMEOUT = "TIMEOUT"
    UNKNOWN_TENANT = "UNKNOWN_TENANT"
    UNKNOWN_MODEL = "UNKNOWN_MODEL"
    UNKNOWN_HASH_SCHEME = "UNKNOWN_HASH_SCHEME"


# ---------------------------------------------------------------------------------------------
# Ingest inputs (attribute names = CacheStateUpdate / PrefixEntry / ReplicaStats / CacheEvent)


class PrefixLike(Protocol):
    @property
    def prefix_hash(self) -> bytes: ...
    @property
    def token_count(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...
    @property
    def block_token_counts(self) -> Sequence[int]: ...
    @property
    def tier(self) -> int: ...
    @property
    def adapter_id(self) -> str: ...


class StatsLike(Protocol):
    @property
    def cache_memory_bytes(self) -> int: ...
    @property
    def hit_rate(self) -> float: ...
    @property
    def pressure(self) -> float: ...
    @property
    def t2_hit_tokens(self) -> int: ...
    @property
    def t2_query_tokens(self) -> int: ...


class EventLike(Protocol):
    """One CacheEvent. A batched ``PREFIX_EVICTED`` also carries ``prefix_hashes`` (field 8,
    read with ``getattr``: shapes without it are single-hash events)."""

    @property
    def type(self) -> int: ...
    @property
    def replica_id(self) -> str: ...
    @property
    def model_id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def prefix_hash(self) -> bytes: ...
    @property
    def timestamp_us(self) -> int: ...
    @property
    def adapter_id(self) -> str: ...


class UpdateLike(Protocol):
    """One CacheStateUpdate. ``stats`` None means absent; a protobuf message may be passed as is
    (its ``HasField("stats")`` decides presence)."""

    @property
    def replica_id(self) -> str: ...
    @property
    def model_id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def hash_scheme(self) -> str: ...
    @property
    def timestamp_us(self) -> int: ...
    @property
    def prefixes(self) -> Sequence[PrefixLike]: ...
    @property
    def stats(self) -> StatsLike | None: ...
    @property
    def adapter_id(self) -> str: ...


@dataclass(slots=True)
class Prefix:
    prefix_hash: bytes = b""
    token_count: int = 0
    block_hashes: Sequence[bytes] = ()
    block_token_counts: Sequence[int] = ()
    tier: int = 0
    adapter_id: str = ""


@dataclass(slots=True)
class Stats:
    cache_memory_bytes: int = 0
    hit_rate: float = 0.0
    pressure: float = 0.0
    t2_hit_tokens: int = 0
    t2_query_tokens: int = 0


@dataclass(slots=True)
class Update:
    """One CacheStateUpdate. ``stats`` is None when the message carries no stats."""

    replica_id: str = ""
    model_id: str = ""
    tenant_id: str = ""
    hash_scheme: str = ""
    timestamp_us: int = 0
    prefixes: Sequence[PrefixLike] = ()
    stats: StatsLike | None = None
    adapter_id: str = ""


@dataclass(slots=True)
class Event:
    type: int = 0
    replica_id: str = ""
    model_id: str = ""
    tenant_id: str = ""
    prefix_hash: bytes = b""
    timestamp_us: int = 0
    adapter_id: str = ""
    prefix_hashes: Sequence[bytes] = ()


@dataclass(slots=True)
class LegacyRun:
    """Consecutive legacy ``PrefixEntry`` messages of one update in a compact form: no chain
    fields, 8-byte ``prefix_hash`` each, one wire ``tier`` and one entry-level ``adapter_id``.

    ``hashes`` is the entries' prefix hashes concatenated (8 bytes each, wire order) and
    ``token_counts[i]`` entry i's ``token_count`` (int32). Applying a run equals applying its
    entries one by one (contract-and-index.md §4.2), with one store call.
    """

    hashes: bytes
    token_counts: Sequence[int]
    tier: int = 0
    adapter_id: str = ""


@dataclass(slots=True)
class PackedUpdate:
    """A CacheStateUpdate in the compact form of the server's wire parser (``updatewire``).

    ``entries`` holds the ``PrefixEntry`` list in wire order, runs of legacy entries as
    ``LegacyRun`` and any other entry as a ``PrefixLike``. Everything else is as in ``Update``.
    """

    replica_id: str = ""
    model_id: str = ""
    tenant_id: str = ""
    hash_scheme: str = ""
    timestamp_us: int = 0
    entries: Sequence[LegacyRun | PrefixLike] = ()
    stats: StatsLike | None = None
    adapter_id: str = ""


# ---------------------------------------------------------------------------------------------
# Lookup input and output


@dataclass(slots=True)
class LookupRequest:
    """One LookupRoute request as the pipeline sees it (contract-and-index.md §5.1-§5.2).

    ``block_hashes`` is a sequence of bytes, or one ``bytes`` of concatenated 8-byte hashes when
    ``packed_hashes`` is True (the server's fast path). ``token_ids`` is a sequence of ints, or
    the raw payload of the packed ``repeated uint32`` field when ``token_varints`` is True (the
    server then never materialises the ids as Python ints). ``deadline`` is the caller's deadline
    on the pipeline's monotonic clock, or None.
    """

    tenant_id: str = ""
    model_id: str = ""
    hash_scheme: str = ""
    adapter_id: str = ""
    prefix_hash: bytes = b""
    prefix_token_count: int = 0
    block_hashes: Sequence[bytes] | bytes = ()
    packed_hashes: bool = False
    block_token_counts: Sequence[int] = ()
    token_ids: Sequence[int] | bytes = ()
    token_varints: bool = False
    prompt_text: str = ""
    ttft_ms: int = 0
    deadline: float | None = None


class ReplicaScore(NamedTuple):
    """One ranked replica of a LookupRoute answer (the contract's ``ReplicaScore``). A named
    tuple: the compiled ranker builds one per returned replica through the tuple API."""

    replica_id: str
    score: float = 0.0
    matched_tokens: int = 0
    estimated_cache_hit_prob: float = 0.0
    tier: int = 0


@dataclass(slots=True)
class LookupResult:
    reason_code: str
    replica_scores: list[ReplicaScore] = field(default_factory=list)
    lookup_latency_us: int = 0
    token_ids: Sequence[int] = ()
    adapter_id: str = ""


@dataclass(slots=True)
class ReplicaStatsRow:
    """One stats row of GetCacheState (contract-and-index.md §5.13); ``client_version`` is always
    empty."""

    replica_id: str
    cache_memory_bytes: int = 0
    hit_rate: float = 0.0
    pressure: float = 0.0
    t2_hit_tokens: int = 0
    t2_query_tokens: int = 0


@dataclass(slots=True)
class CacheState:
    """GetCacheStateResponse: rows sorted by replica_id, and the CacheSummary counts."""

    replicas: list[ReplicaStatsRow] = field(default_factory=list)
    total_prefixes: int = 0
    hot_prefixes: int = 0
