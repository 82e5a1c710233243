"""The contract's ingest message ``CacheStateUpdate`` in compact form, straight from/to wire bytes.

Why: the subscriber reports one legacy ``PrefixEntry`` per engine block, thousands per update,
and Python protobuf costs ~1-3 µs per entry to build on one side and to read on the other. Here
the server turns a run of consecutive legacy entries (8-byte ``prefix_hash``, no chain fields,
one tier, one entry ``adapter_id``) into one packed ``bytes`` of hashes plus a list of token
counts (the index stores it with one ``upsert_many`` call, ``index.LegacyRun``), and the
subscriber writes its entries into wire bytes without protobuf objects. The wire stays standard
v1alpha1 in both directions.

- ``parse_update(buf)`` → ``(replica_id, model_id, tenant_id, hash_scheme, timestamp_us,
  adapter_id, entries)`` or ``None``. ``entries`` are in wire order: ``(hashes, token_counts,
  tier, adapter_id)`` for a legacy run, ``(prefix_hash, token_count, block_hashes,
  block_token_counts, tier, adapter_id)`` for any other entry. ``None`` means "let protobuf
  decide": stats present, an invalid tag, a wire-type mismatch on a known field, a truncated
  field, invalid UTF-8, groups, a varint protobuf might read differently. Unknown fields are
  skipped, repeated scalars are last-wins, ``int32`` values wrap as protobuf reads them, so a
  message parsed here means exactly what protobuf would make of it.
- ``encode_entries(entries)`` → the ``prefixes`` field (6) of a ``CacheStateUpdate`` for
  ``(prefix_hash, token_count, adapter_id, tier)`` tuples, byte for byte what protobuf writes;
  prepend ``encode_header(...)`` for a whole message.

Two implementations with identical results: the C accelerator ``_native`` (when built) and the
pure-Python twin ``pure`` (``INFERENCECACHE_PURE_PYTHON=1`` forces it; with
``INFERENCECACHE_REQUIRE_NATIVE=1`` a missing build is an ImportError).
"""

from __future__ import annotations

from typing import Literal

from inferencecache import accelerators, varint
from inferencecache.ingestwire.pure import GenericItem, LegacyItem, Parsed

IMPLEMENTATION: Literal["native", "python"]
if accelerators.load("inferencecache.ingestwire._native") is not None:
    from ._native import encode_entries, parse_update

    IMPLEMENTATION = "native"
else:
    from .pure import encode_entries, parse_update

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
    "GenericItem",
    "LegacyItem",
    "Parsed",
    "encode_entries",
    "encode_header",
    "parse_update",
    "timestamp_field",
]
