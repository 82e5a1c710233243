"""Raw msgpack token/hash arrays (``kvevents.packed``): the C accelerator equals the twin, and
the twin equals msgspec's typed decoding (the definition)."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferencecache import accelerators
from inferencecache.kvevents import packed

IMPLS: dict[str, Any] = {"pure": (packed.token_array_py, packed.hash_keys_py)}
_native = accelerators.built("inferencecache.kvevents._native")
if _native is not None:
    IMPLS["native"] = (_native.token_array, _native.hash_keys)

enc = msgspec.msgpack.Encoder()


def ints_any_width(values: list[int], widths: list[int]) -> bytes:
    """A msgpack array of ints, each in a chosen (legal, possibly wider) encoding."""
    out = bytearray()
    n = len(values)
    out += bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
    for v, w in zip(values, widths, strict=True):
        if v >= 0 and w == 0 and v < 0x80:
            out.append(v)
        elif -32 <= v < 0 and w == 0:
            out += struct.pack(">b", v)
        elif v >= 0 and w in (1, 2, 3) and v < 2 ** (8 * (1 << (w - 1))):
            fmt = {1: ">B", 2: ">H", 3: ">I"}[w]
            out += bytes([0xCB + w]) + struct.pack(fmt, v)
        elif v >= 2**63:
            out += b"\xcf" + struct.pack(">Q", v)
        else:
            out += b"\xd3" + struct.pack(">q", v)
    return bytes(out)


values = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(-40, 300),
                   st.sampled_from([0, 2**32 - 1, 2**32, -1, 2**63, 2**63 - 1]))


@settings(max_examples=400, deadline=None)
@given(st.lists(values, max_size=20), st.data())
def test_every_int_encoding(vals: list[int], data: st.DataObject) -> None:
    widths = data.draw(st.lists(st.integers(0, 3), min_size=len(vals), max_size=len(vals)))
    raw = ints_any_width(vals, widths)
    assert msgspec.msgpack.decode(raw) == vals
    outs = {name: (list(tok(raw)) if tok(raw) is not None else None, keys(raw))
            for name, (tok, keys) in IMPLS.items()}
    assert len({repr(o) for o in outs.values()}) == 1, outs
    tokens, keys = outs["pure"]
    assert tokens == (vals if all(0 <= v < 2**32 for v in vals) else None)
    assert keys == [(v % 2**64).to_bytes(8, "big") for v in vals]


junk = st.recursive(st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False),
                              st.integers(-(2**63), 2**64 - 1), st.binary(max_size=4),
                              st.text(max_size=3)),
                    lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(junk, st.integers(0, 3))
def test_anything_else_is_declined_identically(obj: Any, cut: int) -> None:
    raw = enc.encode(obj)
    for data in (raw, raw[: max(0, len(raw) - cut)], raw + b"\x00"):
        outs = {}
        for name, (tok, keys) in IMPLS.items():
            t = tok(data)
            outs[name] = (None if t is None else list(t), keys(data))
        assert len({repr(o) for o in outs.values()}) == 1, (data, outs)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_nil_is_empty_and_bools_floats_are_declined(impl: str) -> None:
    tok, keys = IMPLS[impl]
    assert list(tok(b"\xc0")) == [] and keys(b"\xc0") == []
    for bad in ([True], [1.0], [[1, 2]], "x", 5):
        assert tok(enc.encode(bad)) is None
    assert keys(enc.encode([True])) is None and keys(enc.encode([b"\x01" * 32])) is None


def test_token_ids_behave_like_a_list_of_ints() -> None:
    t = packed.token_array(enc.encode([1, 2, 2**32 - 1]))
    assert isinstance(t, packed.TokenIds) and t.itemsize == 4
    assert t == [1, 2, 2**32 - 1] and t != [1, 2] and t == packed.TokenIds([1, 2, 2**32 - 1])
    assert list(t) == [1, 2, 2**32 - 1] and len(t) == 3 and t[2] == 2**32 - 1
    assert repr(t) == "TokenIds([1, 2, 4294967295])"
    with pytest.raises(TypeError):
        hash(t)
