"""Contract messages the subscriber sends (contract-and-index.md §2.3,
engine-events-and-subscriber.md §3.5).

Entries travel inside the subscriber as plain tuples ``(prefix_hash, token_count, adapter_id,
tier)`` and become wire bytes only here, right before a send: ``UpdateEncoder`` writes a
``CacheStateUpdate`` without protobuf objects (``updatewire``: C, else protobuf itself; byte for
byte what protobuf writes), ``build_update`` is the protobuf reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferencecache import updatewire
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

# (prefix_hash as 8-byte big-endian, cumulative token_count, adapter_id, tier)
Entry = tuple[bytes, int, str, int]

PREFIX_EVICTED: int = pb.CacheEvent.PREFIX_EVICTED
ALL_CLEARED: int = pb.CacheEvent.ALL_CLEARED


@dataclass(frozen=True, slots=True)
class Identity:
    """Who reports: stamped on every update and event."""

    replica_id: str
    model_id: str
    tenant_id: str
    hash_scheme: str


def build_update(ident: Identity, entries: list[Entry], timestamp_us: int) -> pb.CacheStateUpdate:
    """One ``CacheStateUpdate``: one legacy PrefixEntry per block, update-level adapter empty."""
    update = pb.CacheStateUpdate(
        replica_id=ident.replica_id,
        model_id=ident.model_id,
        tenant_id=ident.tenant_id,
        hash_scheme=ident.hash_scheme,
        timestamp_us=timestamp_us,
    )
    add = update.prefixes.add
    for prefix, tokens, adapter, tier in entries:
        add(prefix_hash=prefix, token_count=tokens, adapter_id=adapter, tier=tier)
    return update


class UpdateEncoder:
    """``build_update(...).SerializeToString()`` without protobuf objects (identity cached)."""

    __slots__ = ("_head",)

    def __init__(self, ident: Identity) -> None:
        self._head = updatewire.encode_header(
            ident.replica_id, ident.model_id, ident.tenant_id, ident.hash_scheme, 0)

    def encode(self, entries: Sequence[Entry], timestamp_us: int) -> bytes:
        return (self._head + updatewire.timestamp_field(timestamp_us)
                + updatewire.encode_entries(entries))


def build_event(
    ident: Identity,
    kind: int,
    timestamp_us: int,
    prefix: bytes = b"",
    adapter: str = "",
    more: Sequence[bytes] = (),
) -> pb.CacheEvent:
    """A ``CacheEvent`` (prefix and adapter only for evictions; ``more`` = the further hashes
    of a batched eviction, field 8 ``prefix_hashes``)."""
    return pb.CacheEvent(
        type=kind,  # type: ignore[arg-type]
        replica_id=ident.replica_id,
        model_id=ident.model_id,
        tenant_id=ident.tenant_id,
        prefix_hash=prefix,
        adapter_id=adapter,
        timestamp_us=timestamp_us,
        prefix_hashes=more,
    )


_MAX_US = (1 << 63) - 1


def timestamp_us(ts: float) -> int:
    """``int(ts × 1e6)`` for a positive, finite, representable ts; else 0 ("now" at the server)."""
    if ts > 0:
        us = ts * 1e6
        if us < _MAX_US:
            return int(us)
    return 0
