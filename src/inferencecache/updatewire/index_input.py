"""Ingest wire bytes → the index's input shapes: an ICB1 batch (``index/batch.py``, for
``Index.apply_batch``), a ``PackedUpdate``, an ``Update``, or protobuf's ``CacheEvent``.

The one decoder of each message for everyone who applies it: the server's ReportCacheState and
PublishEvent deserializers (``server.report_request``) and every event-log replica
(``eventlog``), which re-reads the very bytes the server accepted, so the log is applied exactly
as direct ingest is. The compiled packers (``pack_update`` / ``pack_event``: the usual update,
a batched eviction) and ``parse_update`` do the work; whatever they leave (groups, every
malformed message), and everything when they are not built, goes to protobuf, the definition
of *decodable*.
"""

from __future__ import annotations

from collections.abc import Callable

from inferencecache import accelerators, updatewire
from inferencecache.index.model import LegacyRun, PackedUpdate, Prefix, PrefixLike, Stats, Update
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


def decode_protobuf(buf: bytes) -> Update | None:
    """Protobuf's decoding (None: undecodable)."""
    try:
        msg = pb.CacheStateUpdate.FromString(buf)
    except Exception:  # DecodeError, and whatever else a broken message makes protobuf raise
        return None
    return update_from_message(msg)


def decode_update(buf: bytes) -> PackedUpdate | Update | None:
    """One update's bytes → the index's input; None when protobuf cannot decode them. Never
    raises."""
    parse = updatewire.parse_update
    if parse is not None:
        try:
            parsed = parse(buf)
        except Exception:  # defensive: a parser bug must not escape
            parsed = None
        if parsed is not None:
            return packed_from_parsed(parsed)
        accelerators.fell_back("update_request")
    return decode_protobuf(buf)


def _packed(pack: Callable[[bytes], bytes | None] | None, buf: bytes) -> bytes | None:
    if pack is None:
        return None
    try:
        return pack(buf)
    except Exception:  # defensive: a parser bug must not escape
        return None


def decode_update_for_apply(buf: bytes) -> bytes | PackedUpdate | Update | None:
    """Like ``decode_update``, but the usual update (one run of legacy entries) comes back as
    an ICB1 batch (``bytes``) for ``Index.apply_batch``."""
    packed = _packed(updatewire.pack_update, buf)
    return packed if packed is not None else decode_update(buf)


def decode_event_for_apply(buf: bytes) -> bytes | pb.CacheEvent | None:
    """One ``CacheEvent``: a batched ``PREFIX_EVICTED`` with 8-byte hashes as an ICB1 batch,
    any other event as protobuf's message; None when protobuf cannot decode it."""
    packed = _packed(updatewire.pack_event, buf)
    if packed is not None:
        return packed
    try:
        event: pb.CacheEvent = pb.CacheEvent.FromString(buf)
    except Exception:
        return None
    return event
