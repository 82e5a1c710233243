"""The fingerprint (token ids -> XXH3 chain): the C accelerator against the pure-Python twin
(which hashes with the ``xxhash`` package) on every input form: int lists, packed arrays,
protobuf varint payloads, a parent hash, any block size."""

from __future__ import annotations

import struct
from array import array
from typing import Any

import xxhash

from inferencecache import accelerators
from inferencecache.fingerprint import SEED
from inferencecache.fingerprint import pure as py

_C: Any = accelerators.built("inferencecache.fingerprint._native")


def _same(f: Any, g: Any, *args: Any) -> None:
    try:
        want: Any = ("ok", f(*args))
    except (ValueError, TypeError, OverflowError) as e:
        want = ("error", type(e).__name__)
    try:
        got: Any = ("ok", g(*args))
    except (ValueError, TypeError, OverflowError) as e:
        got = ("error", type(e).__name__)
    assert got == want, (g.__name__, got, want)


def check(data: bytes) -> None:
    if len(data) < 3:
        return
    mode, bs_byte, rest = data[0], data[1], data[2:4096]  # the pure twin is slow: keep it short
    block_size = (bs_byte % 33) if bs_byte < 0xF0 else (1 << 31) - (0xFF - bs_byte)
    parent: int | None = None
    if mode & 1 and len(rest) >= 8:
        parent, rest = struct.unpack("<Q", rest[:8])[0], rest[8:]
    if _C is None:
        return
    assert _C.xxh3_64(rest, SEED) == xxhash.xxh3_64_intdigest(rest, SEED)
    words = array("I", rest[: len(rest) // 4 * 4])
    ints = words.tolist()
    if mode & 2:
        ints = [*ints, -1] if mode & 4 else [*ints, 1 << 32]  # out of range: both refuse
    fn = ("prefix_hashes", "chain_packed", "chain")[mode % 3]
    tokens: Any = (ints, words, rest)[(mode >> 3) % 3]
    _same(getattr(py, fn), getattr(_C, fn), tokens, block_size, parent)
    for fn in ("varint_count", "decode_varints", "split_packed"):
        _same(getattr(py, fn), getattr(_C, fn), rest)
    _same(py.chain_from_varints, _C.chain_from_varints, rest, block_size, parent)


def seeds() -> list[bytes]:
    toks = array("I", range(64)).tobytes()
    return [b"\x00\x10" + toks, b"\x01\x04" + b"\x07" * 8 + toks, b"\x00\x10" + bytes(range(128)),
            b"\x02\x01" + b"\xff\xff\xff\xff\x0f" * 4, b"\x00\xff" + toks]
