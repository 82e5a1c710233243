"""The one place the fuzz harnesses touch the protobuf wire parsers.

Each function takes wire bytes and returns a plain, comparable reading (``None``: not
decodable / declined), so a refactor of the parsers only has to change this file. Protobuf is
the reference and the only pure-Python decoder (docs/decisions.md, "one decoder per message").
What is called:

LookupRouteRequest (``lookup_request.py``):
- :func:`lookup_server` -> ``inferencecache.server.lookup_wire.parse_lookup_request`` (what the
  server runs: the compiled ``_lookupwire.parse``, else protobuf);
- :func:`lookup_compiled` -> ``inferencecache.server._lookupwire.parse`` (``None`` = declines);
- :func:`lookup_reference` -> ``LookupRouteRequest.FromString`` + ``lookup_wire.from_message``.

CacheStateUpdate (``cache_state_update.py``):
- :func:`update_server` -> ``inferencecache.server.report_request.parse_update_request`` (an
  ICB1 batch for the usual update, else the compact or protobuf form; compared by effect);
- :func:`update_compiled` -> ``inferencecache.updatewire.parse_update`` (``None`` = declines);
- :func:`update_reference` -> ``CacheStateUpdate.FromString`` +
  ``report_request.update_from_message``.
"""

from __future__ import annotations

import math
from typing import Any

from inferencecache import accelerators, updatewire
from inferencecache.fingerprint import decode_varints, split_packed
from inferencecache.index import batch
from inferencecache.index.model import LegacyRun, LookupRequest, PackedUpdate, Update
from inferencecache.server import lookup_wire, report_request
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

ABOVE_U32 = "token varint above 2**32-1"
"""The fast paths keep token ids as raw varints; one above u32 reads as this marker (protobuf
truncates it to 32 bits; the index rejects the request: both mean "no token ids")."""

_LOOKUPWIRE = accelerators.built("inferencecache.server._lookupwire")


# ---- LookupRouteRequest ---------------------------------------------------------------------


def _lookup_norm(r: LookupRequest) -> tuple[Any, ...]:
    if r.packed_hashes:
        assert isinstance(r.block_hashes, bytes)
        hashes = split_packed(r.block_hashes)
    else:
        hashes = [bytes(h) for h in r.block_hashes]
    tokens: Any
    if r.token_varints:
        assert isinstance(r.token_ids, bytes)
        try:
            tokens = list(decode_varints(r.token_ids))
        except ValueError:
            tokens = ABOVE_U32
    else:
        tokens = list(r.token_ids)
    return (
        r.tenant_id, r.model_id, r.hash_scheme, r.adapter_id, bytes(r.prefix_hash),
        r.prefix_token_count, hashes, list(r.block_token_counts), tokens, r.prompt_text,
        r.ttft_ms,
    )


def lookup_server(buf: bytes) -> tuple[Any, ...] | None:
    got = lookup_wire.parse_lookup_request(buf)
    return None if got is lookup_wire.UNDECODABLE else _lookup_norm(got)  # type: ignore[arg-type]


def lookup_compiled(buf: bytes) -> tuple[Any, ...] | None:
    if _LOOKUPWIRE is None:
        return None
    fields = _LOOKUPWIRE.parse(buf)
    if fields is None:
        return None
    return _lookup_norm(LookupRequest(*fields))


def lookup_reference(buf: bytes) -> tuple[Any, ...] | None:
    try:
        msg = pb.LookupRouteRequest.FromString(buf)
    except Exception:
        return None
    return _lookup_norm(lookup_wire.from_message(msg))


def lookup_same(got: tuple[Any, ...], want: tuple[Any, ...]) -> bool:
    """Equal readings, a token payload above u32 matching any token list."""
    if got[8] == ABOVE_U32 or want[8] == ABOVE_U32:
        return got[:8] + got[9:] == want[:8] + want[9:]
    return got == want


# ---- CacheStateUpdate -----------------------------------------------------------------------


def _entries_flat(entries: Any) -> list[tuple[Any, ...]]:
    flat: list[tuple[Any, ...]] = []
    for e in entries:
        if isinstance(e, LegacyRun):
            assert len(e.hashes) == 8 * len(e.token_counts)
            flat += [(bytes(e.hashes[8 * i : 8 * i + 8]), c, [], [], e.tier, e.adapter_id)
                     for i, c in enumerate(e.token_counts)]
        else:
            flat.append((bytes(e.prefix_hash), e.token_count,
                         [bytes(h) for h in e.block_hashes], list(e.block_token_counts),
                         int(e.tier), e.adapter_id))
    return flat


def _stats_norm(stats: Any) -> tuple[Any, ...] | None:
    if stats is None:
        return None
    return (stats.cache_memory_bytes, _float_norm(stats.hit_rate), _float_norm(stats.pressure),
            stats.t2_hit_tokens, stats.t2_query_tokens)


def _float_norm(x: float) -> float | str:
    """NaN compares unequal to itself: two readings that agree on a NaN must compare equal."""
    return "nan" if math.isnan(x) else x


def _update_norm(u: Update | PackedUpdate) -> tuple[Any, ...]:
    """What an update does to the index, whatever its form: its entries (with the adapter each
    one lands in) and its stats, with the routing fields they apply under (an ICB1 batch keeps
    exactly these; an update without entries or stats does nothing in any form)."""
    entries = u.entries if isinstance(u, PackedUpdate) else u.prefixes
    flat = [(*e[:5], e[5] or u.adapter_id) for e in _entries_flat(entries)]
    stats = _stats_norm(u.stats)
    where = (u.tenant_id, u.model_id, u.replica_id, u.timestamp_us)
    return ((*where, u.hash_scheme) if flat else None, flat,
            (*where, stats) if stats is not None else None)


def _batch_norm(data: bytes) -> tuple[Any, ...]:
    """``_update_norm`` of an ICB1 batch (the server's packed form of the usual update)."""
    head: tuple[Any, ...] | None = None
    flat: list[tuple[Any, ...]] = []
    stats: tuple[Any, ...] | None = None
    for rec in batch.records(data):
        r = rec.route
        where = (r.tenant, r.model, r.replica, rec.timestamp_us)
        if rec.kind == batch.STORE:
            head = (*where, r.scheme)
            flat += [(rec.hashes[8 * i : 8 * i + 8], c, [], [], rec.tier, r.adapter)
                     for i, c in enumerate(rec.tokens)]
        elif rec.kind == batch.STATS:
            stats = (*where, _stats_norm(rec.stats))
        else:
            raise AssertionError(f"an update packed as record kind {rec.kind}")
    return head, flat, stats


def update_server(buf: bytes) -> tuple[Any, ...] | None:
    got = report_request.parse_update_request(buf)
    if got is lookup_wire.UNDECODABLE:
        return None
    if isinstance(got, bytes):
        return _batch_norm(got)
    return _update_norm(got)  # type: ignore[arg-type]


def update_compiled(buf: bytes) -> tuple[Any, ...] | None:
    """The compiled compact parser's reading (``None`` = declines or not built)."""
    if updatewire.parse_update is None:
        return None
    parsed = updatewire.parse_update(buf)
    return None if parsed is None else _update_norm(report_request.packed_from_parsed(parsed))


def update_reference(buf: bytes) -> tuple[Any, ...] | None:
    try:
        msg = pb.CacheStateUpdate.FromString(buf)
    except Exception:
        return None
    return _update_norm(report_request.update_from_message(msg))
