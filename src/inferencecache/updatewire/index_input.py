"""``CacheStateUpdate`` wire bytes → the index's input shapes (``PackedUpdate`` or ``Update``).

The one decoder of the message for everyone who applies it: the server's ReportCacheState
deserializer (``server.report_request``) and every event-log replica (``eventlog``), which
re-reads the very bytes the server accepted. The compiled ``parse_update`` does the work;
whatever it leaves (groups, every malformed message), and everything when it is not built,
goes to protobuf, the definition of *decodable*.
"""

from __future__ import annotations

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
