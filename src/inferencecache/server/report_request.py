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

from inferencecache.index.model import PackedUpdate, Update
from inferencecache.server import lookup_wire
from inferencecache.updatewire.index_input import (
    decode_event_for_apply,
    decode_protobuf,
    decode_update_for_apply,
    packed_from_parsed,
    update_from_message,
)
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

__all__ = [
    "packed_from_parsed", "parse_event_request", "parse_slow", "parse_update_request",
    "update_from_message",
]  # fmt: skip


def parse_event_request(buf: bytes) -> bytes | pb.CacheEvent | lookup_wire._Undecodable:
    """gRPC request deserializer for PublishEvent: never raises. A batched ``PREFIX_EVICTED``
    with 8-byte hashes becomes an ICB1 batch (``bytes``); any other event is protobuf's."""
    event = decode_event_for_apply(buf)
    return lookup_wire.UNDECODABLE if event is None else event


def parse_slow(buf: bytes) -> Update | lookup_wire._Undecodable:
    """Protobuf's decoding: the definition of *decodable*."""
    update = decode_protobuf(buf)
    return lookup_wire.UNDECODABLE if update is None else update


def parse_update_request(
    buf: bytes,
) -> bytes | PackedUpdate | Update | lookup_wire._Undecodable:
    """gRPC request deserializer for ReportCacheState: never raises. The usual update (one run
    of legacy entries) becomes an ICB1 batch (``bytes``, ``Index.apply_batch``); the decoder
    itself is ``updatewire.index_input``, shared with the event-log replicas."""
    update = decode_update_for_apply(buf)
    return lookup_wire.UNDECODABLE if update is None else update
