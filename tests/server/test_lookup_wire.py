"""The LookupRoute request deserializer agrees with protobuf on every input (decodable or not),
whichever implementation runs (the compiled parser, or protobuf itself without the build)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache.index.model import LookupRequest
from inferencecache.server import lookup_wire
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

from .wirefuzz import mutate, norm, reference, requests


def check(buf: bytes) -> None:
    got = lookup_wire.parse_lookup_request(buf)
    want = reference(buf)
    if want is None:
        assert got is lookup_wire.UNDECODABLE
    else:
        assert got is not lookup_wire.UNDECODABLE
        assert norm(got) == want


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_parser_equals_protobuf_on_valid_messages(req: pb.LookupRouteRequest) -> None:
    check(req.SerializeToString())


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.randoms(use_true_random=False))
def test_bad_input_parser_agrees_with_protobuf_on_mutated_bytes(
    req: pb.LookupRouteRequest, rnd: random.Random
) -> None:
    """Truncations, flipped bytes and inserted garbage: never an exception, same decision."""
    check(mutate(req.SerializeToString(), rnd))


@given(st.binary(max_size=200))
def test_bad_input_random_bytes_never_raise(buf: bytes) -> None:
    check(buf)


def test_unknown_fields_are_skipped() -> None:
    base = pb.LookupRouteRequest(model_id="m", tenant_id="t").SerializeToString()
    extra = (
        b"\x60\x05"  # field 12 varint
        b"\x6a\x03abc"  # field 13 bytes
        b"\x71"
        + b"\x00" * 8  # field 14 fixed64
        + b"\x7d"
        + b"\x00" * 4  # field 15 fixed32
        + b"\xa2\x06\x02hi"  # field 100: a two-byte tag
    )
    got = lookup_wire.parse_lookup_request(base + extra)
    assert isinstance(got, LookupRequest) and (got.model_id, got.tenant_id) == ("m", "t")
    check(base + extra)


def test_unpacked_and_split_repeated_fields_decode_like_protobuf() -> None:
    # token_ids unpacked (wire type 0) and counts split over two packed chunks
    buf = b"\x48\x05\x48\x06" + b"\x42\x01\x10" + b"\x42\x01\x20" + b"\x4a\x01\x07"
    check(buf)
    got = lookup_wire.parse_lookup_request(buf)
    assert norm(got)[7] == [16, 32]
    assert norm(got)[8] == [5, 6, 7]


def test_multibyte_and_negative_counts() -> None:
    req = pb.LookupRouteRequest(block_hashes=[b"a" * 8] * 3, block_token_counts=[128, -1, 16])
    check(req.SerializeToString())
    got = lookup_wire.parse_lookup_request(req.SerializeToString())
    assert isinstance(got, LookupRequest) and list(got.block_token_counts) == [128, -1, 16]


def test_bad_input_invalid_utf8_is_undecodable() -> None:
    assert lookup_wire.parse_lookup_request(b"\x0a\x02\xff\xfe") is lookup_wire.UNDECODABLE


def test_bad_input_token_varint_above_u32() -> None:
    """Protobuf keeps the low 32 bits; the compiled parser hands the raw payload on and the
    index decodes it the same way."""
    buf = b"\x4a\x05\xff\xff\xff\xff\x7f"
    check(buf)
    got = lookup_wire.parse_lookup_request(buf)
    assert isinstance(got, LookupRequest)
    if got.token_varints:
        assert got.token_ids == b"\xff\xff\xff\xff\x7f"
    else:
        assert list(got.token_ids) == [2**32 - 1]


def test_bad_input_truncated_token_varint_is_undecodable() -> None:
    assert lookup_wire.parse_lookup_request(b"\x4a\x02\x01\x80") is lookup_wire.UNDECODABLE


def test_mixed_hash_lengths_keep_order() -> None:
    hashes = [b"12345678", b"xy", b"abcdefgh", b"ABCDEFGH", b""]
    req = pb.LookupRouteRequest(block_hashes=hashes)
    got = lookup_wire.parse_lookup_request(req.SerializeToString())
    assert isinstance(got, LookupRequest) and not got.packed_hashes
    assert list(got.block_hashes) == hashes


def test_slo_messages_merge() -> None:
    buf = b"\x32\x02\x08\x05" + b"\x32\x02\x10\x07"
    check(buf)
    got = lookup_wire.parse_lookup_request(buf)
    assert isinstance(got, LookupRequest) and got.ttft_ms == 5


def test_bad_input_varint_longer_than_ten_bytes_is_undecodable() -> None:
    """CI found this: an 11-byte varint inside packed token_ids; protobuf rejects the message."""
    buf = b"J\x0b\xc2\x80\xf0\x90\x80\x80\xf0\x90\x80\x800"
    assert reference(buf) is None
    assert lookup_wire.parse_lookup_request(buf) is lookup_wire.UNDECODABLE
    check(b"J\x0b" + b"\xff" * 9 + b"\x01\x05")  # 10 bytes: protobuf accepts, so must we


def test_bad_input_varint_cut_at_a_packed_chunk_end_is_undecodable() -> None:
    """Each packed chunk holds whole varints: joining chunks must not mend a cut one."""
    buf = b"J\x01\x80J\x01\x01"
    assert reference(buf) is None
    assert lookup_wire.parse_lookup_request(buf) is lookup_wire.UNDECODABLE
    check(b"J\x01\x05J\x01\x01")
