"""The one place the fuzz harnesses touch the protobuf wire parsers.

Each function takes wire bytes and returns a plain, comparable reading (``None``: not
decodable / declined), so a refactor of the parsers only has to change this file. What is called:

LookupRouteRequest (``lookup_request.py``):
- :func:`lookup_server` -> ``inferencecache.server.wire.parse_lookup_request`` (what the server
  runs: the compiled ``_lookupwire.parse``, else ``wire.parse_fast``, else protobuf);
- :func:`lookup_compiled` -> ``inferencecache.server._lookupwire.parse`` (``None`` = declines);
- :func:`lookup_fast` -> ``inferencecache.server.wire.parse_fast`` (``None`` = declines);
- :func:`lookup_reference` -> ``LookupRouteRequest.FromString`` + ``wire.from_message``.

CacheStateUpdate (``cache_state_update.py``):
- :func:`update_server` -> ``inferencecache.server.ingest.parse_update_request``;
- :func:`update_compact` -> ``inferencecache.ingestwire._native.parse_update`` and
  ``inferencecache.ingestwire.pure.parse_update`` (``None`` = declines);
- :func:`update_reference` -> ``CacheStateUpdate.FromString`` + ``ingest.update_from_message``.
"""

from __future__ import annotations

from typing import Any

from inferencecache import accelerators, varint
from inferencecache.fingerprint import decode_varints, split_packed
from inferencecache.index.model import LegacyRun, LookupRequest, PackedUpdate, Update
from inferencecache.ingestwire import pure as ingest_pure
from inferencecache.server import ingest, wire
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

ABOVE_U32 = "token varint above 2**32-1"
"""The fast paths keep token ids as raw varints; one above u32 reads as this marker (protobuf
truncates it to 32 bits; the index rejects the request: both mean "no token ids")."""

_LOOKUPWIRE = accelerators.built("inferencecache.server._lookupwire")
_INGEST_NATIVE = accelerators.built("inferencecache.ingestwire._native")


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
    got = wire.parse_lookup_request(buf)
    return None if got is wire.UNDECODABLE else _lookup_norm(got)  # type: ignore[arg-type]


def lookup_compiled(buf: bytes) -> tuple[Any, ...] | None:
    if _LOOKUPWIRE is None:
        return None
    fields = _LOOKUPWIRE.parse(buf)
    if fields is None:
        return None
    return _lookup_norm(wire._make_request(*fields))


def lookup_fast(buf: bytes) -> tuple[Any, ...] | None:
    try:
        return _lookup_norm(wire.parse_fast(buf))
    except Exception:  # the fast parser declines by raising (_Fallback, UnicodeDecodeError...)
        return None


def lookup_reference(buf: bytes) -> tuple[Any, ...] | None:
    try:
        msg = pb.LookupRouteRequest.FromString(buf)
    except Exception:
        return None
    return _lookup_norm(wire.from_message(msg))


def _fields(buf: bytes) -> list[tuple[int, int, bytes]] | None:
    """Top-level ``(field, wire type, body)`` of a protobuf message (body: the value bytes of a
    varint or fixed field, the payload of a length-delimited one), or None if a tag or length
    cannot be read. Tags and lengths of any varint length are accepted (see
    :func:`lookup_known_divergence`)."""
    out: list[tuple[int, int, bytes]] = []
    pos, n = 0, len(buf)

    def varint() -> int | None:
        nonlocal pos
        v = shift = 0
        while pos < n and shift < 70:
            b = buf[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            if b < 0x80:
                return v
            shift += 7
        return None

    while pos < n:
        tag = varint()
        if tag is None or tag >> 3 == 0:
            return None
        field, wt = tag >> 3, tag & 7
        start = pos
        if wt == 0:
            if varint() is None:
                return None
        elif wt == 1 or wt == 5:
            pos += 8 if wt == 1 else 4
        elif wt == 2:
            length = varint()
            if length is None:
                return None
            start = pos
            pos += length
        else:
            return None
        if pos > n:
            return None
        out.append((field, wt, buf[start:pos]))
    return out


def lookup_known_divergence(buf: bytes) -> tuple[Any, ...] | None:
    """Whether ``buf`` is one of the reported ``LookupRoute`` parser divergences (issue 13):
    protobuf rejects it, but accepts the same request with (a) every tag and length varint
    written minimally (the fast parsers accept tags and lengths in more than 5 bytes) and (b)
    its several ``slo`` (field 6) occurrences merged into one whose payload is their
    concatenation (``wire.parse_fast`` parses the concatenation; protobuf parses each
    occurrence alone). Returns protobuf's reading of that normalized request (the fast
    parsers must read exactly that), or None when ``buf`` is not such a case."""
    fields = _fields(buf)
    if fields is None or lookup_reference(buf) is not None:
        return None
    slo = b"".join(body for f, wt, body in fields if f == 6 and wt == 2)
    out = bytearray()
    for f, wt, body in fields:
        if f == 6 and wt == 2:
            continue
        out += varint.encode(f << 3 | wt)
        if wt == 2:
            out += varint.encode(len(body))
        out += body
    if any(f == 6 and wt == 2 for f, wt, _ in fields):
        out += b"\x32" + varint.encode(len(slo)) + slo
    return lookup_reference(bytes(out))


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


def _update_norm(u: Update | PackedUpdate) -> tuple[Any, ...]:
    entries = u.entries if isinstance(u, PackedUpdate) else u.prefixes
    stats = getattr(u, "stats", None)
    return (u.replica_id, u.model_id, u.tenant_id, u.hash_scheme, u.timestamp_us, u.adapter_id,
            None if stats is None else bytes(stats.SerializeToString()),
            _entries_flat(entries))


def update_server(buf: bytes) -> tuple[Any, ...] | None:
    got = ingest.parse_update_request(buf)
    return None if got is wire.UNDECODABLE else _update_norm(got)  # type: ignore[arg-type]


def update_compact(buf: bytes) -> dict[str, Any]:
    """Both compact parsers' raw results (``None`` = declines), by implementation."""
    out: dict[str, Any] = {"pure": ingest_pure.parse_update(buf)}
    if _INGEST_NATIVE is not None:
        out["native"] = _INGEST_NATIVE.parse_update(buf)
    return out


def update_compact_norm(parsed: Any) -> tuple[Any, ...]:
    return _update_norm(ingest.packed_from_parsed(parsed))


def update_reference(buf: bytes) -> tuple[Any, ...] | None:
    try:
        msg = pb.CacheStateUpdate.FromString(buf)
    except Exception:
        return None
    return _update_norm(ingest.update_from_message(msg))
