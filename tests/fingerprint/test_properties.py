"""Property tests: both implementations equal each other and the spec oracle on random input."""

from __future__ import annotations

from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache.fingerprint import pure
from inferencecache.varint import encode_all as encode_varints

from .conftest import NATIVE, oracle

U32 = st.integers(min_value=0, max_value=2**32 - 1)
TOKEN = st.one_of(st.integers(0, 300), st.integers(0, 200_000), U32)
TOKENS = st.lists(TOKEN, max_size=400)
BLOCK = st.integers(min_value=1, max_value=70)
PARENT = st.one_of(st.none(), st.integers(0, 2**64 - 1))

SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(tokens=TOKENS, b=BLOCK, parent=PARENT)
def test_every_api_matches_the_oracle(
    impl: ModuleType, tokens: list[int], b: int, parent: int | None
) -> None:
    want = oracle(tokens, b, parent)
    wire = [h.to_bytes(8, "big") for h in want]
    assert impl.prefix_hashes(tokens, b, parent) == want
    assert impl.chain_packed(tokens, b, parent) == b"".join(wire)
    assert impl.chain(tokens, b, parent) == (wire, [b] * len(want))
    assert impl.chain_from_varints(encode_varints(tokens), b, parent) == b"".join(wire)
    assert impl.split_packed(b"".join(wire)) == wire


@SETTINGS
@given(tokens=TOKENS, b=BLOCK, cut=st.integers(0, 20))
def test_chaining_across_a_split_point(
    impl: ModuleType, tokens: list[int], b: int, cut: int
) -> None:
    cut_at = min(cut * b, len(tokens) // b * b)  # a block boundary
    first = impl.prefix_hashes(tokens[:cut_at], b)
    rest = impl.prefix_hashes(tokens[cut_at:], b, first[-1] if first else None)
    assert first + rest == impl.prefix_hashes(tokens, b)


@SETTINGS
@given(tokens=TOKENS, b=BLOCK, extra=st.lists(TOKEN, max_size=69))
def test_a_partial_tail_never_changes_the_result(
    impl: ModuleType, tokens: list[int], b: int, extra: list[int]
) -> None:
    full = tokens[: len(tokens) // b * b]
    tail = extra[: b - 1]
    assert impl.prefix_hashes(full + tail, b) == impl.prefix_hashes(full, b)


@SETTINGS
@given(
    tokens=st.lists(TOKEN, min_size=1, max_size=100),
    bad=st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32)),
    data=st.data(),
)
def test_out_of_range_ids_are_rejected(
    impl: ModuleType, tokens: list[int], bad: int, data: st.DataObject
) -> None:
    b = data.draw(st.integers(1, len(tokens)))
    pos = data.draw(st.integers(0, len(tokens) // b * b - 1))  # inside a full block
    tokens = [*tokens[:pos], bad, *tokens[pos + 1 :]]
    with pytest.raises(ValueError):
        impl.prefix_hashes(tokens, b)


@SETTINGS
@given(values=st.lists(st.integers(0, 2**40), max_size=50))
def test_varint_decoding_accepts_exactly_u32(impl: ModuleType, values: list[int]) -> None:
    buf = encode_varints(values)
    assert impl.varint_count(buf) == len(values)
    if all(v <= 2**32 - 1 for v in values):
        assert impl.decode_varints(buf).tolist() == values
    else:
        with pytest.raises(ValueError):
            impl.decode_varints(buf)
        with pytest.raises(ValueError):
            impl.chain_from_varints(buf, 1)


@pytest.mark.skipif(NATIVE is None, reason="C accelerator not built")
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=2000), tokens=TOKENS, b=st.integers(-3, 70), parent=PARENT)
def test_native_equals_pure_on_arbitrary_bytes(
    data: bytes, tokens: list[int], b: int, parent: int | None
) -> None:
    """Raw byte buffers (as le32 ids when the length allows) and arbitrary varint payloads."""
    assert NATIVE is not None

    def outcome(fn, *args):  # type: ignore[no-untyped-def]
        try:
            return ("ok", fn(*args))
        except (ValueError, TypeError) as err:
            return (type(err).__name__, None)

    for name in ("prefix_hashes", "chain_packed", "chain"):
        assert outcome(getattr(NATIVE, name), data, b, parent) == outcome(
            getattr(pure, name), data, b, parent
        )
    for name in ("varint_count", "decode_varints", "split_packed"):
        assert outcome(getattr(NATIVE, name), data) == outcome(getattr(pure, name), data)
    assert outcome(NATIVE.chain_from_varints, data, b, parent) == outcome(
        pure.chain_from_varints, data, b, parent
    )
    assert NATIVE.prefix_hashes(tokens, b, parent) == pure.prefix_hashes(tokens, b, parent)
