"""The compiled LookupRoute wire helpers (``server._lookupwire``) against protobuf itself.

- ``parse``: whenever it answers, the ``LookupRequest`` means what protobuf reads from the same
  bytes; it answers every request protobuf decodes (no groups in these), and never one protobuf
  rejects.
- ``encode``: whenever it answers, the bytes equal protobuf's serialization of the reference
  construction (``lookup_wire.response_from_result``); it declines (None) exactly where protobuf
  would convert or reject a value, and ``lookup_wire.encode_response`` then raises as protobuf
  does.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache import accelerators
from inferencecache.index.apply import f32
from inferencecache.index.model import LookupRequest, LookupResult, ReplicaScore
from inferencecache.server import lookup_wire
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

from .wirefuzz import mutate, norm, reference, requests

LW = accelerators.built("inferencecache.server._lookupwire")
pytestmark = pytest.mark.skipif(LW is None, reason="C accelerator not built")


def c_parse(buf: bytes) -> LookupRequest | None:
    assert LW is not None
    fields = LW.parse(buf)
    return None if fields is None else LookupRequest(*fields)


def agree(buf: bytes) -> bool:
    """The compiled parser's answer (if any) is protobuf's reading, and it never answers what
    protobuf rejects; returns whether it answered."""
    got = c_parse(buf)
    want = reference(buf)
    if want is None:
        assert got is None, buf
        return False
    if got is None:
        return False
    assert norm(got) == want
    return True


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_parse_equals_protobuf_on_valid_messages(req: pb.LookupRouteRequest) -> None:
    assert agree(req.SerializeToString())


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.randoms(use_true_random=False))
def test_bad_input_parse_equals_protobuf_on_mutated_bytes(
    req: pb.LookupRouteRequest, rnd: random.Random
) -> None:
    agree(mutate(req.SerializeToString(), rnd))


@given(st.binary(max_size=200))
def test_bad_input_random_bytes(buf: bytes) -> None:
    agree(buf)


def test_parse_keeps_gateway_shapes_packed() -> None:
    hashes = [i.to_bytes(8, "big") for i in range(512)]
    chain = pb.LookupRouteRequest(
        model_id="m", tenant_id="t", hash_scheme="vllm", adapter_id="a",
        block_hashes=hashes, block_token_counts=[16] * 512,
    )  # fmt: skip
    tokens = pb.LookupRouteRequest(model_id="m", tenant_id="t", hash_scheme="vllm",
                                   token_ids=[1, 300, 70_000])  # fmt: skip
    exact = pb.LookupRouteRequest(model_id="m", tenant_id="t", hash_scheme="vllm",
                                  prefix_hash=b"p" * 8, prefix_token_count=-3)  # fmt: skip
    slo = pb.LookupRouteRequest(tenant_id="t", prompt_text="héllo")
    slo.slo.ttft_ms = -5
    slo.slo.tbt_ms = 9
    for msg in (chain, tokens, exact, slo, pb.LookupRouteRequest()):
        assert agree(msg.SerializeToString()), msg
    got = c_parse(chain.SerializeToString())
    assert got is not None and got.packed_hashes and got.block_hashes == b"".join(hashes)
    # counts that fit a byte stay one bytes object (a Sequence[int] the walk reads as is)
    assert got.block_token_counts == bytes([16]) * 512
    got = c_parse(tokens.SerializeToString())
    assert got is not None and got.token_varints and got.token_ids == b"\x01\xac\x02\xf0\xa2\x04"
    # mixed hash lengths keep their order as a list
    mixed = pb.LookupRouteRequest(block_hashes=[b"12345678", b"xy", b""])
    got = c_parse(mixed.SerializeToString())
    assert got is not None and not got.packed_hashes
    assert got.block_hashes == [b"12345678", b"xy", b""]
    # an 8-byte hash with a two-byte length is still an 8-byte hash
    odd = b"\x3a\x08" + b"a" * 8 + b"\x3a\x88\x00" + b"x" * 8
    assert agree(odd)
    got = c_parse(odd)
    assert got is not None and got.packed_hashes and got.block_hashes == b"a" * 8 + b"x" * 8


def test_parse_grows_past_its_inline_buffers() -> None:
    """A 512-block chain of 8-byte and odd hashes, counts above a byte, split token payloads."""
    big = pb.LookupRouteRequest(
        block_hashes=[i.to_bytes(8, "big") for i in range(600)] + [b"odd"],
        block_token_counts=[300 + i for i in range(601)],
        token_ids=list(range(70_000, 70_900)),
    ).SerializeToString()
    assert agree(big)
    got = c_parse(big)
    assert got is not None and list(got.block_token_counts) == [300 + i for i in range(601)]
    assert agree(big + b"\x4a\x02\x01\x02" * 20)  # 20 more packed chunks


def test_parse_reads_every_valid_shape() -> None:
    """What an older parser left to Python: unknown fields, multi-byte and unpacked counts,
    unpacked token ids, SLO messages with other fields, long tags."""
    for buf in (
        b"\x60\x05",  # unknown varint field 12
        b"\x42\x02\x80\x01",  # a two-byte count
        b"\x40\x90\x03\x40\x7f",  # unpacked counts
        b"\x48\x05",  # an unpacked token id
        b"\x32\x02\x18\x01",  # SLO with an unknown field
        b"\xa2\x06\x02hi",  # a two-byte tag
        b"\x8a\x80\x80\x80\x00\x01m",  # field 1 with its tag in five bytes
        b"\x08\x01",  # field 1 with another wire type: an unknown field to protobuf
    ):
        assert agree(buf), buf


def test_parse_declines_groups_and_everything_protobuf_rejects() -> None:
    assert LW is not None
    for buf in (
        b"\x4a\x02\x01\x80",  # token payload ending inside a varint
        b"\x0a\x02\xff\xfe",  # invalid UTF-8
        b"\x63\x64",  # a group: left to protobuf
        b"\x8a\x80\x80\x80\x80\x00\x01m",  # a tag in six bytes
        b"\x0a\x81\x80\x80\x80\x80\x00m",  # a length in six bytes
        b"\x20" + b"\xff" * 10 + b"\x01",  # an 11-byte varint
    ):
        assert LW.parse(buf) is None, buf
    assert LW.parse(bytearray(b"")) is None  # type: ignore[arg-type]  # not bytes


# ---------------------------------------------------------------------------------------------
# Encoder


INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, math.inf, -math.inf, math.nan, 3.4028234663852886e38]),
    st.floats(width=32),
    st.floats(-1e6, 1e6).map(f32),
)
TEXT = st.one_of(st.sampled_from(["", "r0", "replica-é", "\U0001f600"]), st.text(max_size=12))


@st.composite
def results(draw: st.DrawFn) -> LookupResult:
    scores = [
        ReplicaScore(draw(TEXT), draw(FLOATS), draw(INT32), draw(FLOATS), draw(INT32))
        for _ in range(draw(st.integers(0, 6)))
    ]
    tokens: Any = draw(
        st.one_of(st.just(()), st.lists(st.integers(0, 2**32 - 1), max_size=20))
    )
    if draw(st.booleans()):
        tokens = tuple(tokens)
    return LookupResult(
        draw(st.sampled_from(["PREFIX_MATCH", "NO_HINT", ""])),
        scores,
        draw(st.one_of(st.integers(0, 10**6), st.integers(-(2**63), 2**63 - 1))),
        tokens,
        draw(TEXT),
    )


def encode(res: Any) -> bytes | None:
    assert LW is not None
    out: bytes | None = LW.encode(res)
    return out


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(results())
def test_encoder_bytes_equal_protobuf(res: LookupResult) -> None:
    want = lookup_wire.response_from_result(res).SerializeToString()
    got = encode(res)
    assert got is not None  # every value here is one protobuf stores as given
    assert got == want
    assert pb.LookupRouteResponse.FromString(got) == lookup_wire.response_from_result(res)


OUT_OF_RANGE: list[tuple[str, Any]] = [
    ("matched_tokens", 2**31),
    ("tier", -(2**31) - 1),
    ("score", 1e300),  # protobuf narrows it to inf
    ("score", 1),  # an int: protobuf converts it
    ("matched_tokens", True),  # protobuf rejects bools
    ("replica_id", "\ud800"),  # not encodable as UTF-8
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_encoder_declines_and_protobuf_decides(field: str, value: Any) -> None:
    score = ReplicaScore("r", 1.0, 16, 1.0, 1)._replace(**{field: value})
    res = LookupResult("PREFIX_MATCH", [score], 5, (), "")
    assert encode(res) is None
    try:
        want: Any = lookup_wire.response_from_result(res).SerializeToString()
    except Exception as e:
        want = type(e)
    try:
        got: Any = lookup_wire.encode_response(res)
    except Exception as e:
        got = type(e)
    assert got == want


def test_encoder_declines_other_shapes() -> None:
    assert encode(LookupResult("X", [], 2**63, (), "")) is None
    assert encode(LookupResult("X", [], 0, [2**32], "")) is None
    assert encode(LookupResult("X", [], 0, b"\x01", "")) is None
    assert encode("not a result") is None
    assert encode(LookupResult("X", ["not a score"], 0, [], "")) is None  # type: ignore[list-item]
