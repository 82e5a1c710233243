"""Packed repeated uint32 payloads (protobuf varints): counting, decoding, hashing."""

from __future__ import annotations

import random
from array import array
from types import ModuleType

import pytest

from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.varint import encode_all as encode_varints

from .conftest import oracle


def packed(impl: ModuleType, tokens: list[int], b: int, parent: int | None = None) -> bytes:
    return b"".join(h.to_bytes(8, "big") for h in oracle(tokens, b, parent))


# The first and last value of every varint length (1..5 bytes), and 2**31.
EDGE_VALUES = [0, 127, 128, 2**14 - 1, 2**14, 2**21 - 1, 2**21, 2**28 - 1, 2**28, 2**31, 2**32 - 1]


@pytest.mark.parametrize("value", EDGE_VALUES)
def test_single_varint_of_every_length(impl: ModuleType, value: int) -> None:
    buf = encode_varints([value])
    assert impl.varint_count(buf) == 1
    assert impl.decode_varints(buf) == array("I", [value])
    assert impl.chain_from_varints(buf, 1) == packed(impl, [value], 1)


def test_mixed_lengths_and_long_payloads(impl: ModuleType) -> None:
    rnd = random.Random(87)
    for n in (0, 1, 15, 16, 17, 100, 1000, 5000):
        tokens = [
            rnd.choice(EDGE_VALUES) if rnd.random() < 0.2 else rnd.randrange(200_000)
            for _ in range(n)
        ]
        buf = encode_varints(tokens)
        assert impl.varint_count(buf) == n
        assert impl.decode_varints(buf).tolist() == tokens
        for b in (1, 7, 16, 32, 64):
            assert impl.chain_from_varints(buf, b) == packed(impl, tokens, b)
            assert impl.chain_from_varints(buf, b, 3735928559) == packed(
                impl, tokens, b, 3735928559
            )


def test_matches_protobuf_field_9_of_lookup_route_request(impl: ModuleType) -> None:
    """The payload as LookupRouteRequest.token_ids really puts it on the wire."""
    tokens = [128000, 0, 1, 127, 128, 2**32 - 1, 2**31, 99_999] * 4
    wire = pb.LookupRouteRequest(token_ids=tokens).SerializeToString()
    assert wire[0] == (9 << 3) | 2  # field 9, length-delimited: the packed encoding
    length = wire[1] | ((wire[2] & 0x7F) << 7) if wire[1] & 0x80 else wire[1]
    payload = wire[len(wire) - length :]
    assert payload == encode_varints(tokens)
    assert impl.varint_count(payload) == len(tokens)
    assert impl.chain_from_varints(payload, 16) == impl.chain_packed(tokens, 16)
    assert impl.chain_from_varints(memoryview(wire)[len(wire) - length :], 16) == impl.chain_packed(
        tokens, 16
    )


def test_empty_payload(impl: ModuleType) -> None:
    assert impl.varint_count(b"") == 0
    assert impl.decode_varints(b"") == array("I")
    assert impl.chain_from_varints(b"", 16) == b""


def test_partial_block_and_non_positive_block_size(impl: ModuleType) -> None:
    buf = encode_varints(list(range(100, 120)))
    assert impl.chain_from_varints(buf, 16) == packed(impl, list(range(100, 116)), 16)
    assert impl.chain_from_varints(buf, 0) == b""
    assert impl.chain_from_varints(buf, -5) == b""
    assert impl.chain_from_varints(buf, 21) == b""


def test_overlong_encodings_of_in_range_values_are_accepted(impl: ModuleType) -> None:
    """Protobuf allows up to 10 bytes; redundant zero groups do not change the value."""
    cases = {
        bytes([0x81, 0x00]): 1,
        bytes([0x80, 0x80, 0x80, 0x80, 0x00]): 0,
        bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x0F]): 2**32 - 1,
        bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x8F, 0x80, 0x80, 0x80, 0x80, 0x00]): 2**32 - 1,
        bytes([0x85] + [0x80] * 8 + [0x00]): 5,
    }
    for buf, value in cases.items():
        assert impl.decode_varints(buf).tolist() == [value], buf.hex()
        assert impl.chain_from_varints(buf * 3, 3) == packed(impl, [value] * 3, 3)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(encode_varints([2**32]), id="2**32"),
        pytest.param(encode_varints([2**35 - 1]), id="5-byte-max"),
        pytest.param(encode_varints([2**64 - 1]), id="u64-max"),
        pytest.param(bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x10]), id="5th-byte-0x10"),
        pytest.param(bytes([0x80] * 9 + [0x01]), id="bit-63"),
        pytest.param(bytes([0x80] * 10 + [0x00]), id="11-bytes"),
        pytest.param(bytes([0x80] * 40 + [0x00]), id="41-bytes"),
    ],
)
def test_over_range_or_too_long_varints_raise(impl: ModuleType, bad: bytes) -> None:
    for buf in (
        bad,
        encode_varints(list(range(100))) + bad,
        bad + encode_varints(list(range(100))),
    ):
        with pytest.raises(ValueError):
            impl.decode_varints(buf)
        with pytest.raises(ValueError):
            impl.chain_from_varints(buf, 16)
        with pytest.raises(ValueError):
            impl.chain_from_varints(buf, 0)  # the whole payload is validated, even unhashed


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(b"\x80", id="lone-continuation"),
        pytest.param(b"\x01\x02\xff", id="cut-after-two"),
        pytest.param(encode_varints(list(range(200))) + b"\x80\x80", id="cut-long"),
        pytest.param(encode_varints([2**32 - 1])[:-1], id="cut-max"),
    ],
)
def test_truncated_varints_raise(impl: ModuleType, bad: bytes) -> None:
    with pytest.raises(ValueError, match="truncated"):
        impl.varint_count(bad)
    with pytest.raises(ValueError, match="truncated"):
        impl.decode_varints(bad)
    with pytest.raises(ValueError, match="truncated"):
        impl.chain_from_varints(bad, 1)


def test_varint_count_is_cheap_and_counts_terminators(impl: ModuleType) -> None:
    """varint_count bounds a request before decoding; values are checked by the decoders."""
    over = encode_varints([2**40, 5])
    assert impl.varint_count(over) == 2
    with pytest.raises(ValueError):
        impl.decode_varints(over)


@pytest.mark.parametrize(
    "prefix", [b"", b"\x01", b"\x01\x02\x03", encode_varints(list(range(90)))]
)
def test_varint_count_rejects_varints_longer_than_ten_bytes(
    impl: ModuleType, prefix: bytes
) -> None:
    """Protobuf refuses a message holding an 11-byte varint; the count must refuse it too."""
    ten = b"\xff" * 9 + b"\x01"  # the longest varint protobuf accepts
    assert impl.varint_count(prefix + ten + b"\x05") == impl.varint_count(prefix) + 2
    eleven = b"\xc2\x80\xf0\x90\x80\x80\xf0\x90\x80\x80\x30"  # found by the wire fuzz test
    with pytest.raises(ValueError, match=f"offset {len(prefix)} is longer than 10 bytes"):
        impl.varint_count(prefix + eleven + b"\x05")
    with pytest.raises(ValueError, match="longer than 10 bytes"):
        impl.varint_count(prefix + b"\x80" * 30 + b"\x01")


def test_buffer_types(impl: ModuleType) -> None:
    buf = encode_varints(list(range(300, 364)))
    want = impl.chain_packed(list(range(300, 364)), 16)
    for b in (buf, bytearray(buf), memoryview(buf), memoryview(b"xx" + buf)[2:]):
        assert impl.chain_from_varints(b, 16) == want
        assert impl.varint_count(b) == 64
    with pytest.raises(TypeError):
        impl.chain_from_varints(list(buf), 16)
    with pytest.raises(TypeError):
        impl.varint_count(64)
    with pytest.raises(TypeError):
        impl.decode_varints("abc")


def test_decoded_array_feeds_the_buffer_fast_path(impl: ModuleType) -> None:
    tokens = list(range(1000, 1064))
    ids = impl.decode_varints(encode_varints(tokens))
    assert ids.typecode == "I"
    assert impl.chain_packed(ids, 16) == impl.chain_packed(tokens, 16)
