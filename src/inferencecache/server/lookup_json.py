"""JSON bodies of the HTTP lookup listener (``server/lookup_http.py``): ``POST /v1/lookup`` in
the contract's own JSON mapping, and ``POST /query`` in the shape of NVIDIA Dynamo's standalone
KV indexer, both turned into the index's ``LookupRequest`` and back.

``/v1/lookup`` speaks protobuf's JSON mapping of ``LookupRouteRequest`` / ``LookupRouteResponse``
(bytes as base64, enums by name, field names as in the .proto or lowerCamelCase). The usual
request (snake_case names, plain types) is decoded by msgspec in one call; anything msgspec
does not take exactly (camelCase names, ``null``, numbers as strings, URL-safe base64, ...) is
handed to protobuf's ``json_format.Parse``, the definition of a valid body, so the set of
accepted bodies and their values are protobuf's (the hand-over is counted in
``inferencecache_native_fallbacks_total{site="lookup_json"}``). Answers are written with
snake_case names and every field present; ``json_format.Parse`` reads them back into the very
``LookupRouteResponse`` the gRPC method returns (tested).

``/query`` takes Dynamo's ``{"token_ids": [...], "model_name": "..."}`` (plus our optional
``tenant_id``, ``hash_scheme`` and ``lora_name`` = adapter) and answers with Dynamo's
``{"scores": {"<replica>": {"0": matched_tokens}}, "frequencies": [], "instances":
{"<replica>": {"longest_matched", "gpu", "dp", "cpu", "disk"}}}`` (docs/server.md).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final

import msgspec
from google.protobuf import json_format

from inferencecache import accelerators
from inferencecache.index.model import LookupRequest, LookupResult
from inferencecache.server import lookup_wire
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

I32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]

DEFAULT_TENANT: Final = "default"
DEFAULT_HASH_SCHEME: Final = "vllm"
"""What ``/query`` asks for when the body names no tenant or scheme: the subscriber's defaults."""


class _Slo(msgspec.Struct, forbid_unknown_fields=True):
    ttft_ms: I32 = 0
    tbt_ms: I32 = 0


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    """``LookupRouteRequest`` in protobuf's JSON mapping, snake_case names, plain types."""

    model_id: str = ""
    tenant_id: str = ""
    prefix_hash: bytes = b""
    prefix_token_count: I32 = 0
    hash_scheme: str = ""
    slo: _Slo | None = None
    block_hashes: list[bytes] = []
    block_token_counts: list[I32] = []
    token_ids: list[U32] = []
    prompt_text: str = ""
    adapter_id: str = ""


class DynamoQuery(msgspec.Struct):
    """Dynamo's ``POST /query`` body; unknown fields are ignored, as Dynamo (serde) does."""

    token_ids: list[U32]
    model_name: str
    tenant_id: str = DEFAULT_TENANT
    hash_scheme: str = DEFAULT_HASH_SCHEME
    lora_name: str | None = None


_decode_request = msgspec.json.Decoder(_Request).decode
_decode_query = msgspec.json.Decoder(DynamoQuery).decode
_encode = msgspec.json.Encoder().encode
_TIER_NAMES = {v: k for k, v in pb.CacheTier.items()}


def _from_struct(r: _Request) -> LookupRequest:
    return LookupRequest(
        tenant_id=r.tenant_id,
        model_id=r.model_id,
        hash_scheme=r.hash_scheme,
        adapter_id=r.adapter_id,
        prefix_hash=r.prefix_hash,
        prefix_token_count=r.prefix_token_count,
        block_hashes=r.block_hashes,
        block_token_counts=r.block_token_counts,
        token_ids=r.token_ids,
        prompt_text=r.prompt_text,
        ttft_ms=r.slo.ttft_ms if r.slo is not None else 0,
    )


def parse_slow(body: bytes) -> LookupRequest | lookup_wire._Undecodable:
    """Protobuf's JSON mapping: the definition of a valid ``/v1/lookup`` body."""
    try:
        msg = json_format.Parse(body, pb.LookupRouteRequest())
    except (json_format.ParseError, ValueError, TypeError, RecursionError):
        return lookup_wire.UNDECODABLE
    return lookup_wire.from_message(msg)


def parse_request(body: bytes) -> LookupRequest | lookup_wire._Undecodable:
    """A ``/v1/lookup`` JSON body; never raises."""
    try:
        return _from_struct(_decode_request(body))
    except (msgspec.ValidationError, msgspec.DecodeError):
        accelerators.fell_back("lookup_json")
        return parse_slow(body)


def parse_query(body: bytes) -> LookupRequest | tuple[int, str]:
    """A Dynamo ``/query`` body, or (HTTP status, reason) as Dynamo answers: 422 for JSON of
    another shape, 400 for a body that is not JSON."""
    try:
        q = _decode_query(body)
    except msgspec.ValidationError as e:
        return 422, f"Failed to deserialize the JSON body into the target type: {e}"
    except msgspec.DecodeError as e:
        return 400, f"Failed to parse the request body as JSON: {e}"
    return LookupRequest(
        tenant_id=q.tenant_id,
        model_id=q.model_name,
        hash_scheme=q.hash_scheme,
        adapter_id=q.lora_name or "",
        token_ids=q.token_ids,
    )


def _finite(res: LookupResult) -> bool:
    isfinite = math.isfinite
    return all(isfinite(s.score) and isfinite(s.estimated_cache_hit_prob)
               for s in res.replica_scores)  # fmt: skip


def encode_response(res: LookupResult) -> bytes:
    """A ``LookupRouteResponse`` as JSON (snake_case, every field); NaN and infinities are
    written by protobuf (``"NaN"``, ``"Infinity"``)."""
    if not _finite(res):
        text: str = json_format.MessageToJson(
            lookup_wire.response_from_result(res),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
            indent=None,
        )
        return text.encode()
    tiers = _TIER_NAMES
    doc: dict[str, Any] = {
        "replica_scores": [
            {
                "replica_id": s.replica_id,
                "score": s.score,
                "matched_tokens": s.matched_tokens,
                "estimated_cache_hit_prob": s.estimated_cache_hit_prob,
                "tier": tiers.get(s.tier, s.tier),
            }
            for s in res.replica_scores
        ],
        "reason_code": res.reason_code,
        "lookup_latency_us": res.lookup_latency_us,
        "token_ids": list(res.token_ids),
        "adapter_id": res.adapter_id,
    }
    return _encode(doc)


def encode_dynamo(res: LookupResult) -> bytes:
    """Dynamo's ``/query`` answer: matched tokens per replica (one dp rank, "0"), and per
    replica the tokens matched on GPU / up to CPU / up to disk from the hold's tier (T1 counts
    for all three, T2 for cpu and disk, T3 for disk)."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    if res.reason_code == "PREFIX_MATCH":
        for s in res.replica_scores:
            n = s.matched_tokens
            if n <= 0:
                continue
            tier = s.tier or 1
            scores[s.replica_id] = {"0": n}
            instances[s.replica_id] = {
                "longest_matched": n,
                "gpu": n if tier <= 1 else 0,
                "dp": {"0": n},
                "cpu": n if tier <= 2 else 0,
                "disk": n,
            }
    return _encode({"scores": scores, "frequencies": [], "instances": instances})
