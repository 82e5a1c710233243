"""The contract's ingest message ``CacheStateUpdate`` in compact form, straight from/to wire bytes.

Why: the subscriber reports one legacy ``PrefixEntry`` per engine block, thousands per update,
and Python protobuf costs ~1-3 µs per entry to build on one side and to read on the other. Here
the server turns a run of consecutive legacy entries (8-byte ``prefix_hash``, no chain fields,
one tier, one entry ``adapter_id``) into one packed ``bytes`` of hashes plus a list of token
counts (the index stores it with one ``upsert_many`` call, ``index.LegacyRun``), and the
subscriber writes its entries into wire bytes without protobuf objects. The wire stays standard
v1alpha1 in both directions.

- ``parse_update(buf)`` → ``(replica_id, model_id, tenant_id, hash_scheme, timestamp_us,
  adapter_id, entries, stats)`` or ``None``. ``entries`` are in wire order: ``(hashes,
  token_counts, tier, adapter_id)`` for a legacy run, ``(prefix_hash, token_count, block_hashes,
  block_token_counts, tier, adapter_id)`` for any other entry; ``stats`` is ``(cache_memory_bytes,
  hit_rate, pressure, t2_hit_tokens, t2_query_tokens)`` or None when the update has none. It
  reads any message protobuf decodes, exactly as protobuf reads it; ``None`` means "let
  protobuf decide" (groups, and everything protobuf rejects). ``None`` as the function itself
  means the compiled parser is not in use: protobuf parses everything.
- ``pack_update(buf)`` → the update as an ICB1 batch (``index/batch.py``: one STORE record of
  its entries, a STATS record of its stats) when every entry is legacy with one tier and one
  adapter (a subscriber's usual update), else ``None`` (``parse_update``'s path);
  ``pack_event(buf)`` → a ``PREFIX_EVICTED`` ``CacheEvent`` with 8-byte hashes as one REMOVE
  record, else ``None`` (protobuf's path). Same reading rules as ``parse_update``.
- ``encode_entries(entries)`` → the ``prefixes`` field (6) of a ``CacheStateUpdate`` for
  ``(prefix_hash, token_count, adapter_id, tier)`` tuples, byte for byte what protobuf writes;
  prepend ``encode_header(...)`` for a whole message.

One compiled implementation (``_native.c``); without it (not built, or
``INFERENCECACHE_PURE_PYTHON``) protobuf itself parses and writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from inferencecache import accelerators, varint
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

# (hashes: 8-byte prefix hashes concatenated, token counts, wire tier, entry adapter_id)
LegacyItem = tuple[bytes, list[int], int, str]
# (prefix_hash, token_count, block_hashes, block_token_counts, wire tier, adapter_id)
GenericItem = tuple[bytes, int, list[bytes], list[int], int, str]
# (cache_memory_bytes, hit_rate, pressure, t2_hit_tokens, t2_query_tokens)
StatsItem = tuple[int, float, float, int, int]
# (replica_id, model_id, tenant_id, hash_scheme, timestamp_us, adapter_id, entries, stats)
Parsed = tuple[str, str, str, str, int, str, list[LegacyItem | GenericItem], StatsItem | None]
Entry = tuple[bytes, int, str, int]
"""(prefix_hash, token_count, adapter_id, tier): one legacy ``PrefixEntry``."""


def _encode_entries_pb(entries: Sequence[Entry], /) -> bytes:
    """``encode_entries`` by protobuf itself (no compiled build)."""
    msg = pb.CacheStateUpdate()
    add = msg.prefixes.add
    for entry in entries:
        prefix, tokens, adapter, tier = entry
        if not isinstance(prefix, bytes) or not isinstance(adapter, str):
            raise TypeError("an entry is (bytes, int, str, int)")
        if not -(1 << 31) <= tokens < (1 << 31) or not -(1 << 31) <= tier < (1 << 31):
            raise OverflowError("token_count and tier are int32")
        add(prefix_hash=prefix, token_count=tokens, adapter_id=adapter, tier=tier)  # type: ignore[arg-type]
    return bytes(msg.SerializeToString())


IMPLEMENTATION: Literal["native", "python"]
parse_update: Callable[[bytes], Parsed | None] | None
pack_update: Callable[[bytes], bytes | None] | None
pack_event: Callable[[bytes], bytes | None] | None
encode_entries: Callable[[Sequence[Entry]], bytes]
_native = accelerators.load("inferencecache.updatewire._native")
if _native is not None:
    parse_update = _native.parse_update
    pack_update = _native.pack_update
    pack_event = _native.pack_event
    encode_entries = _native.encode_entries
    IMPLEMENTATION = "native"
else:
    parse_update = pack_update = pack_event = None
    encode_entries = _encode_entries_pb
    IMPLEMENTATION = "python"


def _text_field(tag: int, s: str) -> bytes:
    raw = s.encode()
    return bytes((tag,)) + varint.encode(len(raw)) + raw if raw else b""


def encode_header(
    replica_id: str, model_id: str, tenant_id: str, hash_scheme: str, timestamp_us: int
) -> bytes:
    """Fields 1-5 of a ``CacheStateUpdate`` (proto3: defaults omitted), as protobuf writes
    them; ``header + encode_entries(...)`` is the whole message (no stats, no update-level
    adapter)."""
    return (
        _text_field(0x0A, replica_id)
        + _text_field(0x12, model_id)
        + _text_field(0x1A, tenant_id)
        + _text_field(0x22, hash_scheme)
        + timestamp_field(timestamp_us)
    )


def timestamp_field(timestamp_us: int) -> bytes:
    """Field 5 ``timestamp_us`` of a ``CacheStateUpdate`` (nothing for 0, as protobuf)."""
    return b"\x28" + varint.encode(timestamp_us) if timestamp_us else b""


__all__ = [
    "IMPLEMENTATION",
    "Entry",
    "GenericItem",
    "LegacyItem",
    "Parsed",
    "StatsItem",
    "encode_entries",
    "encode_header",
    "pack_event",
    "pack_update",
    "parse_update",
    "timestamp_field",
]
