"""Pure-Python twin of the fingerprint accelerator (`_native.c`), built on the `xxhash` package.

Used when the C extension is missing or `INFERENCECACHE_PURE_PYTHON=1`. Every function here
returns exactly what its `_native` namesake returns, raises the same exception types, and
accepts the same inputs (tests run both). The rules live in docs/fingerprint.md.
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from typing import TYPE_CHECKING, SupportsIndex

import xxhash
from google.protobuf import descriptor_pb2

from inferencecache import varint

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from typing import TypeAlias

    from typing_extensions import Buffer

    TokenIds: TypeAlias = Iterable[SupportsIndex] | Buffer

SEED = 1337
_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack  # le64(prev) || le64(content): the chain step's input
_HOST_LITTLE = sys.byteorder == "little"

# How a buffer's items are read (see _classify).
_RAW = 0  # bytes-like: consecutive little-endian u32 ids
_LE32 = 1  # unsigned 4-byte items stored little-endian
_BE32 = 2  # unsigned 4-byte items stored big-endian
_OTHER = 3  # anything else: read element by element, like any iterable


def xxh3_64(data: Buffer, seed: SupportsIndex = 0) -> int:
    """XXH3-64 of `data` (the `xxhash` package's, as a twin of `_native.xxh3_64`)."""
    s = _parent(seed)
    return int(_xxh3(_bytes(data), 0 if s is None else s))


# ---- arguments ---------------------------------------------------------------------------


def _bytes(buf: Buffer) -> bytes:
    """The raw bytes of a buffer (TypeError for non-buffers, unlike `bytes(int)`)."""
    return buf if type(buf) is bytes else memoryview(buf).tobytes()


def _block_size(block_size: SupportsIndex) -> int:
    return operator.index(block_size)


def _parent(parent: SupportsIndex | None) -> int | None:
    if parent is None:
        return None
    p = operator.index(parent)
    if not 0 <= p <= _U64_MAX:
        raise ValueError(f"{p!r} is outside 0..18446744073709551615")
    return p


def _classify(fmt: str, itemsize: int) -> int:
    little = _HOST_LITTLE
    if fmt[:1] in ("@", "="):
        fmt = fmt[1:]
    elif fmt[:1] == "<":
        little, fmt = True, fmt[1:]
    elif fmt[:1] in (">", "!"):
        little, fmt = False, fmt[1:]
    if len(fmt) != 1:
        return _OTHER
    if itemsize == 1 and fmt in "Bbc":
        return _RAW
    if itemsize == 4 and fmt in "IL":
        return _LE32 if little else _BE32
    return _OTHER


def _resolve(tokens: TokenIds) -> tuple[Sequence[SupportsIndex] | None, bytes]:
    """`(ids, b"")` for element-wise input, or `(None, le32 bytes)` for a u32 buffer."""
    kind = type(tokens)
    if kind is list or kind is tuple:
        return tokens, b""  # type: ignore[return-value]
    try:
        view = memoryview(tokens)  # type: ignore[arg-type]
    except TypeError:
        return list(tokens), b""  # type: ignore[arg-type]
    with view:
        how = _classify(view.format, view.itemsize)
        if how != _OTHER:
            if view.ndim != 1 or not view.c_contiguous:
                raise TypeError("a token buffer must be one-dimensional and contiguous")
            raw = view.tobytes()
            if how == _RAW and len(raw) % 4:
                raise ValueError(
                    "a token byte buffer holds little-endian u32 ids; "
                    f"its length {len(raw)} is not a multiple of 4"
                )
            if how == _BE32:
                raw = struct.pack(f"<{len(raw) // 4}I", *struct.unpack(f">{len(raw) // 4}I", raw))
            return None, raw
    return list(tokens), b""  # type: ignore[arg-type]


def _le32(ids: Sequence[SupportsIndex], used: int) -> bytes:
    """The first `used` ids as little-endian u32: one struct call, a diagnosis if it fails."""
    ids = ids[:used]  # as of the call, whatever an __index__ method does to the caller's list
    try:
        return struct.pack(f"<{used}I", *ids)
    except struct.error as err:
        for i in range(used):
            v = operator.index(ids[i])  # TypeError for a non-integer, as the C twin
            if not 0 <= v <= _U32_MAX:
                raise ValueError(f"token id {v!r} at index {i} is outside 0..4294967295") from None
        raise ValueError(str(err)) from None


# ---- the chain ---------------------------------------------------------------------------


def _chain(
    tokens: TokenIds, block_size: SupportsIndex, parent: SupportsIndex | None
) -> tuple[list[int], int]:
    """(prefix hashes, block size): the shared body of every token entry point."""
    b = _block_size(block_size)
    p = _parent(parent)
    ids, raw = _resolve(tokens)
    count = len(raw) // 4 if ids is None else len(ids)
    if b <= 0 or count < b:
        return [], b
    blocks = count // b
    used = blocks * b
    if ids is not None:
        raw = _le32(ids, used)
    return _chain_le32(raw, blocks, b, p), b


def _chain_le32(raw: bytes, blocks: int, block_size: int, parent: int | None) -> list[int]:
    h, seed, pair, step = _xxh3, SEED, _pack_pair, 4 * block_size
    contents = [h(raw[o : o + step], seed) for o in range(0, blocks * step, step)]
    if parent is None:
        prev = contents[0]
        out = [prev]
        rest = iter(contents)
        next(rest)
    else:
        prev, out, rest = parent, [], iter(contents)
    append = out.append
    for c in rest:
        prev = h(pair(prev, c), seed)
        append(prev)
    return out


def _packed(hashes: list[int]) -> bytes:
    return struct.pack(f">{len(hashes)}Q", *hashes)


def prefix_hashes(
    tokens: TokenIds, block_size: SupportsIndex, parent: SupportsIndex | None = None
) -> list[int]:
    """Prefix hash (uint64) of every full block of `block_size` tokens."""
    return _chain(tokens, block_size, parent)[0]


def chain_packed(
    tokens: TokenIds, block_size: SupportsIndex, parent: SupportsIndex | None = None
) -> bytes:
    """Every prefix hash as 8-byte big-endian, concatenated (8 bytes per full block)."""
    return _packed(_chain(tokens, block_size, parent)[0])


def chain(
    tokens: TokenIds, block_size: SupportsIndex, parent: SupportsIndex | None = None
) -> tuple[list[bytes], list[int]]:
    """The wire chain: 8-byte big-endian prefix hashes and `[block_size] * n` counts."""
    hashes, b = _chain(tokens, block_size, parent)
    return split_packed(_packed(hashes)), [b] * len(hashes)


def split_packed(packed: Buffer, /) -> list[bytes]:
    """Split concatenated 8-byte hashes into a list of 8-byte `bytes`."""
    data = _bytes(packed)
    if len(data) % 8:
        raise ValueError(f"packed hashes: length {len(data)} is not a multiple of 8")
    return [data[i : i + 8] for i in range(0, len(data), 8)]


# ---- packed repeated uint32 (protobuf varints) -------------------------------------------

_TERMINATORS = bytes(range(0x80))  # bytes that end a varint


def varint_count(buf: Buffer, /) -> int:
    """Number of varints in a packed repeated uint32 payload; ValueError if the last is cut
    or one is longer than 10 bytes (protobuf rejects both)."""
    data = _bytes(buf)
    if data and data[-1] >= 0x80:
        raise ValueError(f"truncated varint at the end of a {len(data)}-byte payload")
    overlong = data.translate(_CONTINUATION).find(b"1" * 10) if len(data) > 10 else -1
    if overlong >= 0:
        raise ValueError(f"varint at byte offset {overlong} is longer than 10 bytes")
    return len(data) - len(data.translate(None, _TERMINATORS))


# Continuation bytes → b"1", terminators → b"0": a run of four "1"s means a 5+ byte varint.
_CONTINUATION = bytes(0x31 if b >= 0x80 else 0x30 for b in range(256))
# A message whose field 1 is `repeated int32 path [packed = true]`: protobuf's own (C, upb)
# parser decodes a packed varint payload wrapped as that field ~10x faster than a Python loop.
# int32 is exact for varints of up to 4 bytes (values below 2**28); longer ones go the slow way.
_PACKED_INT32 = descriptor_pb2.SourceCodeInfo.Location


def _varint_values(buf: Buffer) -> list[int]:
    data = _bytes(buf)
    if data and data[-1] >= 0x80:
        raise ValueError(f"truncated varint at the end of a {len(data)}-byte payload")
    if b"1111" in data.translate(_CONTINUATION):
        return _varint_values_exact(data)
    length = varint.encode(len(data))
    return list(_PACKED_INT32.FromString(b"\x0a" + length + data).path)


def _varint_values_exact(data: bytes) -> list[int]:
    """Byte by byte, for payloads with 5+ byte varints (large, overlong or invalid values)."""
    out: list[int] = []
    append = out.append
    value = shift = length = 0
    start = 0
    for i, byte in enumerate(data):
        value |= (byte & 0x7F) << shift
        length += 1
        if byte < 0x80:
            if value > _U32_MAX:
                raise ValueError(f"varint at byte offset {start} is above 4294967295")
            append(value)
            value = shift = length = 0
            start = i + 1
        elif length == 10:
            raise ValueError(f"varint at byte offset {start} is longer than 10 bytes")
        else:
            shift += 7
    if length:
        raise ValueError(f"truncated varint at byte offset {start}")
    return out


def decode_varints(buf: Buffer, /) -> array[int]:
    """The token ids of a packed repeated uint32 payload as `array.array('I')`."""
    return array("I", _varint_values(buf))


def chain_from_varints(
    buf: Buffer, block_size: SupportsIndex, parent: SupportsIndex | None = None
) -> bytes:
    """`chain_packed()` of the token ids in a packed repeated uint32 payload."""
    b = _block_size(block_size)
    p = _parent(parent)
    ids = _varint_values(buf)
    return chain_packed(ids, b, p)
