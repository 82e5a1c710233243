"""The routing index: a pure library (no gRPC, protobuf, sockets or HTTP). See docs/index.md.

``Index`` holds the state and applies updates/events/sweeps; ``Router`` answers LookupRoute;
``Prober`` runs the ``/probe`` self-test; ``decode_policy_body`` / ``load_policy_file`` build an
``IndexConfig`` for ``Index.replace_config``.
"""

from inferencecache.index.backends import STORE_BACKENDS, default_store_factory
from inferencecache.index.clock import Clock, FakeClock, SystemClock
from inferencecache.index.facade import HoldView, Index, StatsView
from inferencecache.index.lookup_route import PromptTokenizer, Router
from inferencecache.index.metrics import IndexMetrics, NullMetrics, RecordingMetrics
from inferencecache.index.model import (
    MAX_TOKENS,
    PROBE_TENANT,
    CacheState,
    Event,
    EventLike,
    EventType,
    LegacyRun,
    LookupRequest,
    LookupResult,
    PackedUpdate,
    Prefix,
    PrefixLike,
    Reason,
    ReplicaScore,
    ReplicaStatsRow,
    Stats,
    StatsLike,
    Tier,
    Update,
    UpdateLike,
)
from inferencecache.index.probe import Prober, ProbeRequestError, decode_probe_body
from inferencecache.index.settings import IndexSettings
from inferencecache.index.snapshot import rfc3339_us
from inferencecache.index.store import PartitionStore
from inferencecache.index.tenant_config import (
    EffectivePolicy,
    IndexConfig,
    PolicyDecodeError,
    PolicyError,
    Strategy,
    TenantPolicy,
    TenantQuota,
    decode_policy_body,
    load_policy_file,
    parse_policy_document,
)

__all__ = [
    "MAX_TOKENS",
    "PROBE_TENANT",
    "STORE_BACKENDS",
    "CacheState",
    "Clock",
    "EffectivePolicy",
    "Event",
    "EventLike",
    "EventType",
    "FakeClock",
    "HoldView",
    "Index",
    "IndexConfig",
    "IndexMetrics",
    "IndexSettings",
    "LegacyRun",
    "LookupRequest",
    "LookupResult",
    "NullMetrics",
    "PackedUpdate",
    "PartitionStore",
    "PolicyDecodeError",
    "PolicyError",
    "Prefix",
    "PrefixLike",
    "ProbeRequestError",
    "Prober",
    "PromptTokenizer",
    "Reason",
    "RecordingMetrics",
    "ReplicaScore",
    "ReplicaStatsRow",
    "Router",
    "Stats",
    "StatsLike",
    "StatsView",
    "Strategy",
    "SystemClock",
    "TenantPolicy",
    "TenantQuota",
    "Tier",
    "Update",
    "UpdateLike",
    "decode_policy_body",
    "decode_probe_body",
    "default_store_factory",
    "load_policy_file",
    "parse_policy_document",
    "rfc3339_us",
]
