"""The ingest request parsers: ReportCacheState's wire bytes → an ICB1 batch (``index/batch.py``,
the usual update) or the index's compact ``PackedUpdate``; PublishEvent's → a batch (an
eviction) or protobuf's ``CacheEvent``.

Why: Python protobuf materialises every ``PrefixEntry`` as an object and the index then reads
six attributes of each (~2-3 µs per entry), while the subscriber sends one legacy entry per
engine block, thousands per update. The compiled ``updatewire.parse_update`` turns a run of
legacy entries into one packed ``bytes`` of hashes plus a list of token counts, which the index
stores with one ``upsert_many`` call. Protobuf is the only other decoder: whatever the compiled
parser leaves to it (groups, every malformed message; counted in ``accelerators.FALLBACKS``),
and everything when the extension is not built, goes through ``ParseFromString`` and the generic
path, so the set of decodable messages and their effect on the index are exactly protobuf's; a
message protobuf cannot decode becomes ``lookup_wire.UNDECODABLE`` (``INVALID_ARGUMENT``).
"""

from __future__ import annotations

from inferencecache import accelerators, updatewire
from inferencecache.index.model import LegacyRun, PackedUpdate, Prefix, PrefixLike, Stats, Update
from inferencecache.server import lookup_wire
from inferencecache.v1alpha1 import inferencecache_pb2 as pb


def update_from_message(msg: pb.CacheStateUpdate) -> Update:
    """The index's input shape; the repeated ``PrefixEntry`` container passes straight in."""
    return Update(
        replica_id=msg.replica_id,
        model_id=msg.model_id,
        tenant_id=msg.tenant_id,
        hash_scheme=msg.hash_scheme,
        timestamp_us=msg.timestamp_us,
        prefixes=msg.prefixes,
        stats=msg.stats if msg.HasField("stats") else None,
        adapter_id=msg.adapter_id,
    )


def packed_from_parsed(parsed: updatewire.Parsed) -> PackedUpdate:
    """``updatewire.parse_update``'s tuples → ``PackedUpdate`` (a few objects per update)."""
    replica, model, tenant, scheme, ts, adapter, items, stats = parsed
    entries: list[LegacyRun | PrefixLike] = []
    for it in items:
        if len(it) == 4:
            entries.append(LegacyRun(*it))  # type: ignore[arg-type]
        else:
            ph, tc, hashes, counts, tier, ad = it  # type: ignore[misc]
            entries.append(Prefix(ph, tc, hashes, counts, tier, ad))
    return PackedUpdate(
        replica_id=replica,
        model_id=model,
        tenant_id=tenant,
        hash_scheme=scheme,
        timestamp_us=ts,
        entries=entries,
        stats=Stats(*stats) if stats is not None else None,
        adapter_id=adapter,
    )


def parse_event_request(buf: bytes) -> bytes | pb.CacheEvent | lookup_wire._Undecodable:
    """gRPC request deserializer for PublishEvent: never raises. A batched ``PREFIX_EVICTED``
    with 8-byte hashes becomes an ICB1 batch (``bytes``); any other event is protobuf's."""
    pack = updatewire.pack_event
    if pack is not None:
        try:
            packed = pack(buf)
        except Exception:  # defensive, as above
            packed = None
        if packed is not None:
            return packed
    try:
        event: pb.CacheEvent = pb.CacheEvent.FromString(buf)
    except Exception:
        return lookup_wire.UNDECODABLE
    return event


def parse_slow(buf: bytes) -> Update | lookup_wire._Undecodable:
    """Protobuf's decoding: the definition of *decodable*."""
    try:
        msg = pb.CacheStateUpdate.FromString(buf)
    except Exception:  # DecodeError, and whatever else a broken message makes protobuf raise
        return lookup_wire.UNDECODABLE
    return update_from_message(msg)


def parse_update_request(
    buf: bytes,
) -> bytes | PackedUpdate | Update | lookup_wire._Undecodable:
    """gRPC request deserializer for ReportCacheState: never raises. The usual update (one run
    of legacy entries) becomes an ICB1 batch (``bytes``, ``Index.apply_batch``)."""
    pack = updatewire.pack_update
    if pack is not None:
        try:
            packed = pack(buf)
        except Exception:  # defensive: a parser bug must not turn into a gRPC error
            packed = None
        if packed is not None:
            return packed
    parse = updatewire.parse_update
    if parse is not None:
        try:
            parsed = parse(buf)
        except Exception:  # defensive: a parser bug must not turn into a gRPC error
            parsed = None
        if parsed is not None:
            return packed_from_parsed(parsed)
        accelerators.fell_back("update_request")
    return parse_slow(buf)
