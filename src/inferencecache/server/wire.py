"""LookupRouteRequest straight from wire bytes into the index's ``LookupRequest``.

Why: Python protobuf needs ~260 µs to hand out 8192 ``repeated uint32`` token ids as ints and
~35 µs to hand out 512 block hashes one ``bytes`` at a time, which alone would blow the lookup
latency budget. This parser walks the top-level fields itself (a handful of Python steps), passes
the packed ``token_ids`` payload on as raw varints (``token_varints=True``; the fingerprint decodes
and hashes it in C) and turns a run of 8-byte ``block_hashes`` into one packed ``bytes`` with
strided slicing (``packed_hashes=True``).

Anything unusual (a tag above field 15, unpacked repeated numerics, multi-byte block counts,
groups, a truncated field) goes to ``ParseFromString`` instead, so the set of *decodable* requests
is exactly protobuf's. A request protobuf cannot decode either is returned as ``UNDECODABLE``; the
servicer answers it with the contract's fail-open response (see ``docs/server.md``).

One-byte ``block_token_counts`` stay packed as the payload ``bytes`` (a ``Sequence[int]`` of the
same values): the store's walk reads them without 512 Python ints.

When built, the compiled ``_lookupwire.parse`` answers first (~1 µs for a 512-block chain
instead of ~18 µs here); it returns exactly what ``parse_fast`` would, or None for anything but
the common shapes, and then this module decides as before. ``encode_response`` builds the
LookupRouteResponse bytes the same way (compiled ``Encoder``, else protobuf itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from google.protobuf.message import DecodeError

from inferencecache import accelerators, varint
from inferencecache.fingerprint import varint_count
from inferencecache.index.model import LookupRequest, LookupResult, ReplicaScore
from inferencecache.index.ranking import record_maker
from inferencecache.v1alpha1 import inferencecache_pb2 as pb


class _Undecodable:
    """Marker for a LookupRoute request that protobuf itself cannot decode."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNDECODABLE"


UNDECODABLE: Final = _Undecodable()

# Tags (field number << 3 | wire type) of LookupRouteRequest, all one byte.
_T_MODEL = 0x0A  # 1 string
_T_TENANT = 0x12  # 2 string
_T_PREFIX_HASH = 0x1A  # 3 bytes
_T_PREFIX_COUNT = 0x20  # 4 int32 varint
_T_SCHEME = 0x2A  # 5 string
_T_SLO = 0x32  # 6 message
_T_HASHES = 0x3A  # 7 repeated bytes
_T_COUNTS = 0x42  # 8 repeated int32, packed
_T_TOKENS = 0x4A  # 9 repeated uint32, packed
_T_PROMPT = 0x52  # 10 string
_T_ADAPTER = 0x5A  # 11 string

_HASH_TAG_RUN = b"\x3a"
_HASH_LEN_RUN = b"\x08"


class _Fallback(Exception):
    """The fast parser declines; protobuf decides."""


def _int32(v: int) -> int:
    """A varint read as int32 (protobuf truncates to the low 32 bits, two's complement)."""
    v &= 0xFFFFFFFF
    return v - 0x1_0000_0000 if v >= 0x8000_0000 else v


def _varint(buf: bytes, pos: int, n: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= n or shift > 63:
            raise _Fallback
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & 0xFFFF_FFFF_FFFF_FFFF, pos
        shift += 7


def _pack_run(buf: bytes, start: int, k: int) -> bytes:
    """k records ``3a 08 <8 bytes>`` from ``start`` -> the 8k hash bytes, with C-level slicing."""
    rec = buf[start : start + 10 * k]
    out = bytearray(8 * k)
    for j in range(8):
        out[j::8] = rec[2 + j :: 10]
    return bytes(out)


def _hash_run(buf: bytes, start: int, n: int) -> int:
    """How many consecutive ``3a 08 <8 bytes>`` records start at ``start`` (all in C)."""
    tags = buf[start:n:10]
    lens = buf[start + 1 : n : 10]
    k_tags = len(tags) - len(tags.lstrip(_HASH_TAG_RUN))
    k_lens = len(lens) - len(lens.lstrip(_HASH_LEN_RUN))
    return min(k_tags, k_lens, (n - start) // 10)


def _counts(payload: bytes) -> bytes | list[int]:
    if payload.isascii():  # every varint is one byte: the bytes are the values (kept packed)
        return payload
    # Multi-byte or negative counts: let protobuf decode just this field.
    sub = pb.LookupRouteRequest()
    try:
        sub.MergeFromString(bytes([_T_COUNTS]) + varint.encode(len(payload)) + payload)
    except DecodeError as e:
        raise _Fallback from e
    return list(sub.block_token_counts)


def parse_fast(buf: bytes) -> LookupRequest:
    """The fast path; raises ``_Fallback`` whenever protobuf should decide instead."""
    n = len(buf)
    pos = 0
    model = tenant = scheme = prompt = adapter = ""
    prefix_hash = b""
    prefix_count = 0
    slo = b""
    # block hashes as ordered segments: packed runs (bytes of 8k) or single hashes
    packed_segments: list[bytes] = []
    singles: list[tuple[int, bytes]] = []  # (index among segments, hash) for non-8-byte hashes
    counts: bytes | list[int] | None = None
    tokens: bytes | list[bytes] = b""
    while pos < n:
        tag = buf[pos]
        if tag == _T_HASHES and pos + 1 < n and buf[pos + 1] == 8:
            k = _hash_run(buf, pos, n)
            if k:
                packed_segments.append(_pack_run(buf, pos, k))
                pos += 10 * k
                continue
        if tag >= 0x80:
            raise _Fallback  # field number >= 16: not ours, let protobuf skip it
        pos += 1
        wire = tag & 7
        if wire == 2:
            length = buf[pos] if pos < n else 0x80
            if length < 0x80:
                pos += 1
            else:
                length, pos = _varint(buf, pos, n)
            end = pos + length
            if end > n:
                raise _Fallback
            if tag == _T_MODEL:
                model = buf[pos:end].decode()
            elif tag == _T_TENANT:
                tenant = buf[pos:end].decode()
            elif tag == _T_SCHEME:
                scheme = buf[pos:end].decode()
            elif tag == _T_ADAPTER:
                adapter = buf[pos:end].decode()
            elif tag == _T_PROMPT:
                prompt = buf[pos:end].decode()
            elif tag == _T_PREFIX_HASH:
                prefix_hash = buf[pos:end]
            elif tag == _T_HASHES:
                singles.append((len(packed_segments), buf[pos:end]))
                packed_segments.append(b"")
            elif tag == _T_COUNTS:
                part = _counts(buf[pos:end])
                if counts is None:
                    counts = part
                elif isinstance(counts, bytes) and isinstance(part, bytes):
                    counts = counts + part
                else:
                    counts = [*counts, *part]
            elif tag == _T_TOKENS:
                chunk = buf[pos:end]
                if isinstance(tokens, list):
                    tokens.append(chunk)
                elif tokens:
                    tokens = [tokens, chunk]
                else:
                    tokens = chunk
            elif tag == _T_SLO:
                slo += buf[pos:end]  # concatenated messages merge, as protobuf does
            elif tag >> 3 in (0, 4):
                raise _Fallback  # wrong wire type for a known field, or field 0
            pos = end
        elif wire == 0:
            value, pos = _varint(buf, pos, n)
            if tag == _T_PREFIX_COUNT:
                prefix_count = _int32(value)
            elif tag >> 3 <= 11:
                raise _Fallback  # unpacked repeated numerics, a wire-type mismatch, field 0
        elif (wire == 1 or wire == 5) and tag >> 3 > 11:
            pos += 8 if wire == 1 else 4  # an unknown fixed64/fixed32 field
        else:
            raise _Fallback  # groups, invalid wire types, fixed-width known fields
    if pos != n:
        raise _Fallback
    ttft = 0
    if slo:
        try:
            ttft = pb.SLO.FromString(slo).ttft_ms
        except DecodeError as e:
            raise _Fallback from e
    # C scan of each packed chunk (protobuf rejects a varint cut at a chunk's end or longer
    # than 10 bytes): on either, protobuf decides
    try:
        if isinstance(tokens, list):
            for chunk in tokens:
                varint_count(chunk)
            tokens = b"".join(tokens)
        elif tokens:
            varint_count(tokens)
    except ValueError as e:
        raise _Fallback from e
    hashes: bytes | list[bytes]
    packed: bool
    if not singles:
        hashes = packed_segments[0] if len(packed_segments) == 1 else b"".join(packed_segments)
        packed = True
    else:
        single_at = dict(singles)
        hashes = []
        for i, seg in enumerate(packed_segments):
            if i in single_at:
                hashes.append(single_at[i])
            else:
                hashes.extend(seg[j : j + 8] for j in range(0, len(seg), 8))
        packed = False
    return LookupRequest(
        tenant_id=tenant,
        model_id=model,
        hash_scheme=scheme,
        adapter_id=adapter,
        prefix_hash=prefix_hash,
        prefix_token_count=prefix_count,
        block_hashes=hashes,
        packed_hashes=packed,
        block_token_counts=counts if counts is not None else [],
        token_ids=tokens,
        token_varints=True,
        prompt_text=prompt,
        ttft_ms=ttft,
    )


def from_message(msg: pb.LookupRouteRequest) -> LookupRequest:
    """The slow, general translation of a parsed message (fallback and tests)."""
    return LookupRequest(
        tenant_id=msg.tenant_id,
        model_id=msg.model_id,
        hash_scheme=msg.hash_scheme,
        adapter_id=msg.adapter_id,
        prefix_hash=msg.prefix_hash,
        prefix_token_count=msg.prefix_token_count,
        block_hashes=list(msg.block_hashes),
        packed_hashes=False,
        block_token_counts=list(msg.block_token_counts),
        token_ids=list(msg.token_ids),
        token_varints=False,
        prompt_text=msg.prompt_text,
        ttft_ms=msg.slo.ttft_ms,
    )


def parse_slow(buf: bytes) -> LookupRequest | _Undecodable:
    """Protobuf's decoding: the definition of *decodable*."""
    try:
        msg = pb.LookupRouteRequest.FromString(buf)
    except (DecodeError, RuntimeError, ValueError):
        return UNDECODABLE
    return from_message(msg)


def parse_lookup_request(buf: bytes) -> LookupRequest | _Undecodable:
    """gRPC request deserializer for LookupRoute: never raises."""
    if _c_parse is not None:
        try:
            fields = _c_parse(buf)
        except Exception:  # defensive, as below
            fields = None
        if fields is not None:
            return _make_request(*fields)
    try:
        return parse_fast(buf)
    except Exception:  # _Fallback, UnicodeDecodeError, IndexError; defensively any other, as a
        pass  # parser bug must not turn into a gRPC error: protobuf decides below
    return parse_slow(buf)


# ---------------------------------------------------------------------------------------------
# LookupRouteResponse


def response_from_result(res: LookupResult) -> pb.LookupRouteResponse:
    """The protobuf message of a result (the reference of ``encode_response``)."""
    resp = pb.LookupRouteResponse(
        reason_code=res.reason_code,
        lookup_latency_us=res.lookup_latency_us,
        adapter_id=res.adapter_id,
    )
    add = resp.replica_scores.add
    for s in res.replica_scores:
        add(
            replica_id=s.replica_id,
            score=s.score,
            matched_tokens=s.matched_tokens,
            estimated_cache_hit_prob=s.estimated_cache_hit_prob,
            tier=s.tier,  # type: ignore[arg-type]
        )
    if res.token_ids:
        resp.token_ids.extend(res.token_ids)
    return resp


def encode_response(res: LookupResult) -> bytes:
    """LookupRouteResponse bytes of a result, byte-identical to serializing
    ``response_from_result(res)`` (which runs, and raises as protobuf does, whenever the compiled
    encoder declines a value)."""
    if _encoder is not None:
        out: bytes | None = _encoder.encode(res)
        if out is not None:
            return out
    return bytes(response_from_result(res).SerializeToString())


# ---------------------------------------------------------------------------------------------
# The compiled helpers (_lookupwire.c): used when built, unless INFERENCECACHE_PURE_PYTHON.


REQUEST_FIELDS = (
    "tenant_id", "model_id", "hash_scheme", "adapter_id", "prefix_hash", "prefix_token_count",
    "block_hashes", "packed_hashes", "block_token_counts", "token_ids", "token_varints",
    "prompt_text", "ttft_ms", "deadline",
)  # fmt: skip
"""``LookupRequest`` fields in the order of the compiled parser's tuple."""

_LW = accelerators.load("inferencecache.server._lookupwire")
_c_parse: Callable[[bytes], tuple[Any, ...] | None] | None = None
_encoder: Any = None
if _LW is not None:
    _c_parse = _LW.parse
    _encoder = _LW.Encoder(LookupResult, ReplicaScore)
_make_request = record_maker(LookupRequest, REQUEST_FIELDS)
IMPLEMENTATION = "native" if _LW is not None else "python"
