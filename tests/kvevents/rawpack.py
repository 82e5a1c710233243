"""A msgpack writer for hostile inputs: what no well-behaved encoder produces.

``pack`` encodes Python values like msgpack does, plus :class:`Verbatim` (bytes written as they
are: invalid UTF-8 in a str, a malformed timestamp ext, a non-minimal int) and :class:`Pairs`
(a map whose keys may repeat or be unhashable). ``nasty`` is a hypothesis strategy of such
values; ``worst_shapes`` lists the hand-picked worst cases every loop is fed.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st


@dataclass(frozen=True)
class Verbatim:
    """Bytes written into the output unchanged (one whole msgpack value, or not)."""

    data: bytes


class Pairs(list[tuple[Any, Any]]):
    """A msgpack map as written: keys in order, repeats allowed."""


def _head(n: int, fix: int | None, fix_max: int, t8: int | None, t16: int, t32: int) -> bytes:
    if fix is not None and n <= fix_max:
        return bytes([fix | n])
    if t8 is not None and n < 1 << 8:
        return bytes([t8, n])
    if n < 1 << 16:
        return bytes([t16]) + n.to_bytes(2, "big")
    return bytes([t32]) + n.to_bytes(4, "big")


def _int(v: int) -> bytes:
    if 0 <= v < 0x80:
        return bytes([v])
    if -32 <= v < 0:
        return struct.pack(">b", v)
    if v >= 0:
        for code, fmt in ((0xCC, ">B"), (0xCD, ">H"), (0xCE, ">I"), (0xCF, ">Q")):
            try:
                return bytes([code]) + struct.pack(fmt, v)
            except struct.error:
                continue
        raise OverflowError(v)
    for code, fmt in ((0xD0, ">b"), (0xD1, ">h"), (0xD2, ">i"), (0xD3, ">q")):
        try:
            return bytes([code]) + struct.pack(fmt, v)
        except struct.error:
            continue
    raise OverflowError(v)


def str_bytes(data: bytes) -> bytes:
    """A msgpack str whose payload is ``data`` (valid UTF-8 or not)."""
    return _head(len(data), 0xA0, 31, 0xD9, 0xDA, 0xDB) + data


def ext(code: int, data: bytes) -> bytes:
    """A msgpack ext of type ``code`` (-128..127) carrying ``data``."""
    t = code & 0xFF
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if len(data) in fixed:
        return bytes([fixed[len(data)], t]) + data
    return _head(len(data), None, 0, 0xC7, 0xC8, 0xC9) + bytes([t]) + data


def pack(obj: Any) -> bytes:
    """``obj`` as msgpack bytes (see the module docstring for the extra value kinds)."""
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


def _pack(obj: Any, out: bytearray) -> None:
    if isinstance(obj, Verbatim):
        out += obj.data
    elif obj is None:
        out.append(0xC0)
    elif obj is True:
        out.append(0xC3)
    elif obj is False:
        out.append(0xC2)
    elif isinstance(obj, int):
        out += _int(obj)
    elif isinstance(obj, float):
        out += b"\xcb" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        out += str_bytes(obj.encode("utf-8", "surrogatepass"))
    elif isinstance(obj, bytes):
        out += _head(len(obj), None, 0, 0xC4, 0xC5, 0xC6) + obj
    elif isinstance(obj, Pairs):
        out += _head(len(obj), 0x80, 15, None, 0xDE, 0xDF)
        for k, v in obj:
            _pack(k, out)
            _pack(v, out)
    elif isinstance(obj, dict):
        _pack(Pairs(obj.items()), out)
    elif isinstance(obj, list | tuple):
        out += _head(len(obj), 0x90, 15, None, 0xDC, 0xDD)
        for v in obj:
            _pack(v, out)
    else:
        raise TypeError(type(obj).__name__)


def nested(depth: int, kind: str = "array") -> bytes:
    """``depth`` levels of one container kind around a nil: ``array``, ``map`` (one key per
    level), ``mixed`` (arrays and maps alternating) or ``ext`` (an ext whose opaque payload is
    the next level: valid msgpack at any depth, as the payload is never decoded)."""
    if kind == "array":
        return b"\x91" * depth + b"\xc0"
    if kind == "map":
        return b"\x81\xa1k" * depth + b"\xc0"
    if kind == "mixed":
        return b"\x91\x81\xa1k" * (depth // 2) + b"\xc0"
    out = b"\xc0"
    for _ in range(depth):
        out = ext(5, out)
    return out


# Single values that break naive decoders.
INVALID_UTF8: tuple[bytes, ...] = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                                   b"ok\x80")
NASTY_VALUES: tuple[Verbatim, ...] = (
    *(Verbatim(str_bytes(b)) for b in INVALID_UTF8),
    Verbatim(ext(-1, b"\xff" * 4)),  # timestamp 32
    Verbatim(ext(-1, b"\x00" * 8)),  # timestamp 64
    Verbatim(ext(-1, b"\xff" * 12)),  # timestamp 96 with an out-of-range nanosecond field
    Verbatim(ext(-1, b"\x00" * 3)),  # a timestamp of no valid length
    Verbatim(ext(7, b"payload")),
    Verbatim(b"\xcf" + b"\xff" * 8),  # 2^64 - 1
    Verbatim(b"\xd3\x80" + b"\x00" * 7),  # -2^63
    Verbatim(b"\xcf\x00\x00\x00\x00\x00\x00\x00\x01"),  # 1 in a non-minimal uint64
    Verbatim(nested(3000)),
    Verbatim(nested(3000, "map")),
    Verbatim(nested(3000, "mixed")),
    Verbatim(nested(200, "ext")),
    Verbatim(b"\x82\x91\x01\x01\x91\x01\x02"),  # a map with array keys
    Verbatim(b"\x82\xa1a\x01\xa1a\xa1x"),  # a map with a repeated key
    Verbatim(b"\xca\x7f\xc0\x00\x00"),  # float32 NaN
)


def nasty() -> st.SearchStrategy[Any]:
    """Any one hostile value."""
    return st.one_of(
        st.sampled_from(NASTY_VALUES),
        st.builds(lambda b: Verbatim(str_bytes(b)), st.binary(max_size=6)),
        st.builds(lambda c, b: Verbatim(ext(c, b)), st.integers(-128, 127),
                  st.binary(max_size=17)),
    )


@functools.cache
def worst_shapes() -> dict[str, bytes]:
    """Whole payloads, each a worst case for a decoder reading one engine frame."""
    ok_event = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2],
                "block_size": 2}
    shapes: dict[str, bytes] = {
        "deep_array": b"\x92\x00\x91" + nested(100_000),
        "deep_map": b"\x92\x00\x91" + nested(100_000, "map"),
        "ext_deep_payload": b"\x92\x00\x91" + nested(2_000, "ext"),
        "deep_mixed": b"\x92\x00\x91" + nested(30_000, "mixed"),
        "deep_envelope": nested(1_000_000),
        "huge_array_len": b"\x92\x00\xdd\xff\xff\xff\xff",
        "huge_map_len": b"\x92\x00\x91\xdf\xff\xff\xff\xff",
        "huge_str_len": b"\x92\x00\x91\xdb\xff\xff\xff\xff",
        "huge_bin_len": b"\x92\x00\x91\xc6\xff\xff\xff\xff",
        "huge_ext_len": b"\x92\x00\x91\xc9\xff\xff\xff\xff\x05",
        "huge_token_len": pack([0.0, [Pairs([("type", "BlockStored"), ("block_hashes", [1]),
                                             ("block_size", 2),
                                             ("token_ids", Verbatim(b"\xdd\xff\xff\xff\xff"))])]]),
        "ext_envelope": ext(5, pack([0.0, []])),
        "timestamp_ts": pack([Verbatim(ext(-1, b"\x00" * 8)), [ok_event]]),
        "invalid_utf8_tag": pack([0.0, [Pairs([("type", Verbatim(str_bytes(b"\xff")))])]]),
        "invalid_utf8_unknown_key": pack(
            [0.0, [Pairs([*ok_event.items(), (Verbatim(str_bytes(b"\xc3\x28")), 1)])]]),
        "invalid_utf8_skipped_value": pack(
            [0.0, [Pairs([*ok_event.items(), ("session_id", Verbatim(str_bytes(b"\xff")))])]]),
        "invalid_utf8_extra_keys": pack([0.0, [Pairs(
            [*ok_event.items(), ("extra_keys", [Verbatim(str_bytes(b"\xed\xa0"))])])]]),
        "uint64_max_everywhere": pack([2**64 - 1, [Pairs(
            [("type", "BlockStored"), ("block_hashes", [2**64 - 1]), ("token_ids", [2**64 - 1]),
             ("block_size", 2**64 - 1), ("lora_id", 2**64 - 1)])]]),
        "int64_min_everywhere": pack([-(2**63), [Pairs(
            [("type", "BlockStored"), ("block_hashes", [-(2**63)]), ("token_ids", [-(2**63)]),
             ("block_size", -(2**63)), ("lora_id", -(2**63))])]]),
        "million_events": pack([0.0, [None] * 1_000_000]),
        "million_tokens": pack([0.0, [Pairs([("type", "BlockStored"), ("block_hashes", [1]),
                                             ("token_ids", [7] * 1_000_000),
                                             ("block_size", 16)])]]),
        "million_hashes": pack([0.0, [Pairs([("type", "BlockRemoved"),
                                             ("block_hashes", list(range(1_000_000)))])]]),
        "not_msgpack": b"\xc1",
        "empty": b"",
        "trailing_bytes": pack([0.0, []]) + b"\x00",
    }
    return shapes
