from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_TIER_UNSPECIFIED: _ClassVar[CacheTier]
    CACHE_TIER_T1: _ClassVar[CacheTier]
    CACHE_TIER_T2: _ClassVar[CacheTier]
    CACHE_TIER_T3: _ClassVar[CacheTier]
CACHE_TIER_UNSPECIFIED: CacheTier
CACHE_TIER_T1: CacheTier
CACHE_TIER_T2: CacheTier
CACHE_TIER_T3: CacheTier

class RenderTemplateRequest(_message.Message):
    __slots__ = ("template_ref", "variables", "tenant_id")
    class VariablesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEMPLATE_REF_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    template_ref: str
    variables: _containers.ScalarMap[str, str]
    tenant_id: str
    def __init__(self, template_ref: _Optional[str] = ..., variables: _Optional[_Mapping[str, str]] = ..., tenant_id: _Optional[str] = ...) -> None: ...

class RenderTemplateResponse(_message.Message):
    __slots__ = ("rendered_prompt", "stable_prefix_hash", "tenant_namespace", "reason_code", "template_revision")
    RENDERED_PROMPT_FIELD_NUMBER: _ClassVar[int]
    STABLE_PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    TENANT_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    rendered_prompt: bytes
    stable_prefix_hash: bytes
    tenant_namespace: bytes
    reason_code: str
    template_revision: str
    def __init__(self, rendered_prompt: _Optional[bytes] = ..., stable_prefix_hash: _Optional[bytes] = ..., tenant_namespace: _Optional[bytes] = ..., reason_code: _Optional[str] = ..., template_revision: _Optional[str] = ...) -> None: ...

class SLO(_message.Message):
    __slots__ = ("ttft_ms", "tbt_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: int
    tbt_ms: int
    def __init__(self, ttft_ms: _Optional[int] = ..., tbt_ms: _Optional[int] = ...) -> None: ...

class LookupRouteRequest(_message.Message):
    __slots__ = ("model_id", "tenant_id", "prefix_hash", "prefix_token_count", "hash_scheme", "slo", "block_hashes", "block_token_counts", "token_ids", "prompt_text", "adapter_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tenant_id: str
    prefix_hash: bytes
    prefix_token_count: int
    hash_scheme: str
    slo: SLO
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    adapter_id: str
    def __init__(self, model_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., prefix_hash: _Optional[bytes] = ..., prefix_token_count: _Optional[int] = ..., hash_scheme: _Optional[str] = ..., slo: _Optional[_Union[SLO, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_token_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., adapter_id: _Optional[str] = ...) -> None: ...

class ReplicaScore(_message.Message):
    __slots__ = ("replica_id", "score", "matched_tokens", "estimated_cache_hit_prob", "tier")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_CACHE_HIT_PROB_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    score: float
    matched_tokens: int
    estimated_cache_hit_prob: float
    tier: CacheTier
    def __init__(self, replica_id: _Optional[str] = ..., score: _Optional[float] = ..., matched_tokens: _Optional[int] = ..., estimated_cache_hit_prob: _Optional[float] = ..., tier: _Optional[_Union[CacheTier, str]] = ...) -> None: ...

class LookupRouteResponse(_message.Message):
    __slots__ = ("replica_scores", "reason_code", "lookup_latency_us", "token_ids", "adapter_id")
    REPLICA_SCORES_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_LATENCY_US_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    replica_scores: _containers.RepeatedCompositeFieldContainer[ReplicaScore]
    reason_code: str
    lookup_latency_us: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter_id: str
    def __init__(self, replica_scores: _Optional[_Iterable[_Union[ReplicaScore, _Mapping]]] = ..., reason_code: _Optional[str] = ..., lookup_latency_us: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., adapter_id: _Optional[str] = ...) -> None: ...

class LookupPDRouteRequest(_message.Message):
    __slots__ = ("model_id", "tenant_id", "prefix_hash", "prefix_token_count", "pd_topology_ref")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PD_TOPOLOGY_REF_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tenant_id: str
    prefix_hash: bytes
    prefix_token_count: int
    pd_topology_ref: str
    def __init__(self, model_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., prefix_hash: _Optional[bytes] = ..., prefix_token_count: _Optional[int] = ..., pd_topology_ref: _Optional[str] = ...) -> None: ...

class LookupPDRouteResponse(_message.Message):
    __slots__ = ("prefill_replica_id", "decode_replica_id", "transport_hint", "reason_code")
    PREFILL_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_HINT_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    prefill_replica_id: str
    decode_replica_id: str
    transport_hint: str
    reason_code: str
    def __init__(self, prefill_replica_id: _Optional[str] = ..., decode_replica_id: _Optional[str] = ..., transport_hint: _Optional[str] = ..., reason_code: _Optional[str] = ...) -> None: ...

class PrefixEntry(_message.Message):
    __slots__ = ("prefix_hash", "token_count", "block_hashes", "block_token_counts", "tier", "adapter_id")
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    prefix_hash: bytes
    token_count: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_token_counts: _containers.RepeatedScalarFieldContainer[int]
    tier: CacheTier
    adapter_id: str
    def __init__(self, prefix_hash: _Optional[bytes] = ..., token_count: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_token_counts: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[CacheTier, str]] = ..., adapter_id: _Optional[str] = ...) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("replica_id", "cache_memory_bytes", "hit_rate", "pressure", "client_version", "t2_hit_tokens", "t2_query_tokens")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    T2_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    T2_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    cache_memory_bytes: int
    hit_rate: float
    pressure: float
    client_version: str
    t2_hit_tokens: int
    t2_query_tokens: int
    def __init__(self, replica_id: _Optional[str] = ..., cache_memory_bytes: _Optional[int] = ..., hit_rate: _Optional[float] = ..., pressure: _Optional[float] = ..., client_version: _Optional[str] = ..., t2_hit_tokens: _Optional[int] = ..., t2_query_tokens: _Optional[int] = ...) -> None: ...

class CacheStateUpdate(_message.Message):
    __slots__ = ("replica_id", "model_id", "tenant_id", "hash_scheme", "timestamp_us", "prefixes", "stats", "adapter_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_US_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    model_id: str
    tenant_id: str
    hash_scheme: str
    timestamp_us: int
    prefixes: _containers.RepeatedCompositeFieldContainer[PrefixEntry]
    stats: ReplicaStats
    adapter_id: str
    def __init__(self, replica_id: _Optional[str] = ..., model_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., hash_scheme: _Optional[str] = ..., timestamp_us: _Optional[int] = ..., prefixes: _Optional[_Iterable[_Union[PrefixEntry, _Mapping]]] = ..., stats: _Optional[_Union[ReplicaStats, _Mapping]] = ..., adapter_id: _Optional[str] = ...) -> None: ...

class CacheSummary(_message.Message):
    __slots__ = ("total_prefixes", "hot_prefixes")
    TOTAL_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    HOT_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    total_prefixes: int
    hot_prefixes: int
    def __init__(self, total_prefixes: _Optional[int] = ..., hot_prefixes: _Optional[int] = ...) -> None: ...

class GetCacheStateRequest(_message.Message):
    __slots__ = ("model_id", "tenant_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tenant_id: str
    def __init__(self, model_id: _Optional[str] = ..., tenant_id: _Optional[str] = ...) -> None: ...

class GetCacheStateResponse(_message.Message):
    __slots__ = ("replicas", "summary")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStats]
    summary: CacheSummary
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStats, _Mapping]]] = ..., summary: _Optional[_Union[CacheSummary, _Mapping]] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("type", "replica_id", "model_id", "tenant_id", "prefix_hash", "timestamp_us", "adapter_id", "prefix_hashes")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[CacheEvent.Type]
        PREFIX_ADDED: _ClassVar[CacheEvent.Type]
        PREFIX_EVICTED: _ClassVar[CacheEvent.Type]
        REPLICA_UPDATED: _ClassVar[CacheEvent.Type]
        ALL_CLEARED: _ClassVar[CacheEvent.Type]
    TYPE_UNSPECIFIED: CacheEvent.Type
    PREFIX_ADDED: CacheEvent.Type
    PREFIX_EVICTED: CacheEvent.Type
    REPLICA_UPDATED: CacheEvent.Type
    ALL_CLEARED: CacheEvent.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_US_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    type: CacheEvent.Type
    replica_id: str
    model_id: str
    tenant_id: str
    prefix_hash: bytes
    timestamp_us: int
    adapter_id: str
    prefix_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, type: _Optional[_Union[CacheEvent.Type, str]] = ..., replica_id: _Optional[str] = ..., model_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., prefix_hash: _Optional[bytes] = ..., timestamp_us: _Optional[int] = ..., adapter_id: _Optional[str] = ..., prefix_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StreamEventsRequest(_message.Message):
    __slots__ = ("model_id", "tenant_id", "types")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tenant_id: str
    types: _containers.RepeatedScalarFieldContainer[CacheEvent.Type]
    def __init__(self, model_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., types: _Optional[_Iterable[_Union[CacheEvent.Type, str]]] = ...) -> None: ...

class StreamMetricsRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class Metric(_message.Message):
    __slots__ = ("name", "type", "labels", "value", "timestamp_us")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_US_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    labels: _containers.ScalarMap[str, str]
    value: float
    timestamp_us: int
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., value: _Optional[float] = ..., timestamp_us: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("accepted", "reason_code")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason_code: str
    def __init__(self, accepted: _Optional[bool] = ..., reason_code: _Optional[str] = ...) -> None: ...
