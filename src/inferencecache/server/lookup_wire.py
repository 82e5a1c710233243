"""LookupRouteRequest straight from wire bytes into the index's ``LookupRequest``, and the
response back to bytes.

Why: Python protobuf needs ~260 µs to hand out 8192 ``repeated uint32`` token ids as ints and
~35 µs to hand out 512 block hashes one ``bytes`` at a time, which alone would blow the lookup
latency budget. The compiled parser (``_lookupwire.c``, ~1 µs for a 512-block chain) reads any
request protobuf decodes, exactly as protobuf reads it, and keeps the hot fields packed: the
``token_ids`` payload stays raw varints (``token_varints=True``; the fingerprint decodes and
hashes it in C), 8-byte ``block_hashes`` become one ``bytes`` (``packed_hashes=True``), counts
that fit a byte stay one ``bytes`` (a ``Sequence[int]`` the store's walk reads without ints).

Protobuf is the one other decoder and the definition of *decodable*: whatever the compiled
parser does not read (groups; every corrupt input) goes to ``ParseFromString`` (counted in
``accelerators.FALLBACKS``), and so does everything when the extension is not built. A request
protobuf cannot decode is returned as ``UNDECODABLE``; the servicer answers it with the
contract's fail-open response (see ``docs/server.md``). ``encode_response`` builds the
LookupRouteResponse bytes the same way (compiled ``encode``, else protobuf itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from google.protobuf.message import DecodeError

from inferencecache import accelerators
from inferencecache.index.model import LookupRequest, LookupResult
from inferencecache.v1alpha1 import inferencecache_pb2 as pb


class _Undecodable:
    """Marker for a LookupRoute request that protobuf itself cannot decode."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNDECODABLE"


UNDECODABLE: Final = _Undecodable()


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
        except Exception:  # defensive: a parser bug must not turn into a gRPC error
            fields = None
        if fields is not None:
            return LookupRequest(*fields)
        accelerators.fell_back("lookup_request")
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
    if _c_encode is not None:
        out = _c_encode(res)
        if out is not None:
            return out
        accelerators.fell_back("lookup_response")
    return bytes(response_from_result(res).SerializeToString())


# ---------------------------------------------------------------------------------------------
# The compiled helpers (_lookupwire.c): used when built, unless INFERENCECACHE_PURE_PYTHON.

_LW = accelerators.load("inferencecache.server._lookupwire")
_c_parse: Callable[[bytes], tuple[Any, ...] | None] | None = _LW.parse if _LW else None
_c_encode: Callable[[LookupResult], bytes | None] | None = _LW.encode if _LW else None
IMPLEMENTATION = "native" if _LW is not None else "python"
