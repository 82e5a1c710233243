"""The LookupRoute wire parser agrees with protobuf on every input (decodable or not)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache.fingerprint import decode_varints, split_packed
from inferencecache.index.model import LookupRequest
from inferencecache.server import wire
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

from .wirefuzz import mutate, requests


class AboveU32:
    """Token payload holding a varint above 2**32-1 (decoded by the index, as protobuf does)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, list)


def norm(r: LookupRequest | object) -> tuple[object, ...]:
    assert isinstance(r, LookupRequest)
    if r.packed_hashes:
        assert isinstance(r.block_hashes, bytes)
        hashes = split_packed(r.block_hashes)
    else:
        assert not isinstance(r.block_hashes, bytes)
        hashes = list(r.block_hashes)
    tokens: object
    if r.token_varints:
        assert isinstance(r.token_ids, bytes)
        try:
            tokens = list(decode_varints(r.token_ids))
        except ValueError:
            tokens = AboveU32()
    else:
        tokens = list(r.token_ids)
    return (
        r.tenant_id,
        r.model_id,
        r.hash_scheme,
        r.adapter_id,
        r.prefix_hash,
        r.prefix_token_count,
        hashes,
        list(r.block_token_counts),
        tokens,
        r.prompt_text,
        r.ttft_ms,
    )


def reference(buf: bytes) -> tuple[object, ...] | None:
    """What protobuf makes of ``buf`` (None: not decodable)."""
    try:
        msg = pb.LookupRouteRequest.FromString(buf)
    except Exception:
        return None
    return norm(wire.from_message(msg))


def check(buf: bytes) -> None:
    got = wire.parse_lookup_request(buf)
    want = reference(buf)
    if want is None:
        assert got is wire.UNDECODABLE
    else:
        assert got is not wire.UNDECODABLE
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


def test_fast_path_packs_8_byte_hashes_and_keeps_token_varints() -> None:
    req = pb.LookupRouteRequest(
        model_id="m",
        tenant_id="t",
        hash_scheme="vllm",
        block_hashes=[i.to_bytes(8, "big") for i in range(512)],
        block_token_counts=[16] * 512,
        token_ids=[1, 300, 70_000],
    )
    got = wire.parse_fast(req.SerializeToString())
    assert got.packed_hashes
    assert got.block_hashes == b"".join(i.to_bytes(8, "big") for i in range(512))
    assert got.token_varints and got.token_ids == b"\x01\xac\x02\xf0\xa2\x04"
    # one-byte counts stay packed: the payload bytes are the values (a Sequence[int])
    assert got.block_token_counts == bytes([16]) * 512
    assert list(got.block_token_counts) == [16] * 512


def test_unknown_fields_are_skipped() -> None:
    base = pb.LookupRouteRequest(model_id="m", tenant_id="t").SerializeToString()
    extra = (
        b"\x60\x05"  # field 12 varint
        b"\x6a\x03abc"  # field 13 bytes
        b"\x71"
        + b"\x00" * 8  # field 14 fixed64
        + b"\x7d"
        + b"\x00" * 4  # field 15 fixed32
    )
    got = wire.parse_fast(base + extra)
    assert (got.model_id, got.tenant_id) == ("m", "t")
    far = base + b"\xa2\x06\x02hi"  # field 100: two-byte tag, protobuf decides
    check(far)


def test_unpacked_and_split_repeated_fields_decode_like_protobuf() -> None:
    # token_ids unpacked (wire type 0) and counts split over two packed chunks
    buf = b"\x48\x05\x48\x06" + b"\x42\x01\x10" + b"\x42\x01\x20" + b"\x4a\x01\x07"
    check(buf)
    got = wire.parse_lookup_request(buf)
    assert norm(got)[7] == [16, 32]
    assert norm(got)[8] == [5, 6, 7]


def test_multibyte_and_negative_counts() -> None:
    req = pb.LookupRouteRequest(block_hashes=[b"a" * 8] * 3, block_token_counts=[128, -1, 16])
    check(req.SerializeToString())
    got = wire.parse_fast(req.SerializeToString())
    assert list(got.block_token_counts) == [128, -1, 16]


def test_bad_input_invalid_utf8_is_undecodable() -> None:
    assert wire.parse_lookup_request(b"\x0a\x02\xff\xfe") is wire.UNDECODABLE


def test_bad_input_token_varint_above_u32_stays_raw() -> None:
    """The raw payload goes on; the index decodes it the way protobuf would (truncating)."""
    buf = b"\x4a\x05\xff\xff\xff\xff\x7f"
    check(buf)
    got = wire.parse_lookup_request(buf)
    assert isinstance(got, LookupRequest) and got.token_varints
    assert got.token_ids == b"\xff\xff\xff\xff\x7f"


def test_bad_input_truncated_token_varint_is_undecodable() -> None:
    assert wire.parse_lookup_request(b"\x4a\x02\x01\x80") is wire.UNDECODABLE


def test_mixed_hash_lengths_keep_order() -> None:
    hashes = [b"12345678", b"xy", b"abcdefgh", b"ABCDEFGH", b""]
    req = pb.LookupRouteRequest(block_hashes=hashes)
    got = wire.parse_lookup_request(req.SerializeToString())
    assert isinstance(got, LookupRequest) and not got.packed_hashes
    assert list(got.block_hashes) == hashes


def test_slo_messages_merge() -> None:
    buf = b"\x32\x02\x08\x05" + b"\x32\x02\x10\x07"
    check(buf)
    got = wire.parse_lookup_request(buf)
    assert isinstance(got, LookupRequest) and got.ttft_ms == 5


def test_bad_input_varint_longer_than_ten_bytes_is_undecodable() -> None:
    """CI found this: an 11-byte varint inside packed token_ids; protobuf rejects the message."""
    buf = b"J\x0b\xc2\x80\xf0\x90\x80\x80\xf0\x90\x80\x800"
    assert reference(buf) is None
    assert wire.parse_lookup_request(buf) is wire.UNDECODABLE
    check(b"J\x0b" + b"\xff" * 9 + b"\x01\x05")  # 10 bytes: protobuf accepts, so must we


def test_bad_input_varint_cut_at_a_packed_chunk_end_is_undecodable() -> None:
    """Each packed chunk holds whole varints: joining chunks must not mend a cut one."""
    buf = b"J\x01\x80J\x01\x01"
    assert reference(buf) is None
    assert wire.parse_lookup_request(buf) is wire.UNDECODABLE
    check(b"J\x01\x05J\x01\x01")
