"""Token ids and block hashes straight from their raw msgpack arrays (pure-Python twin).

The typed fast decoder (``decode.BatchDecoder``) keeps ``token_ids`` and ``block_hashes`` as
``msgspec.Raw`` and converts them here: token ids become one ``array('I')`` (what the fingerprint
reads without a Python int per token) and hashes the reverse map's 8-byte keys. Materialising 16
Python ints per block was most of the subscriber's decode time. ``None`` means "not the plain
shape": the caller hands the whole batch to the reference decoder, which is authoritative for
every rejection. ``_native`` (C) gives identical results; this twin defines them with msgspec's
own typed decoding, so the accepted set is exactly what ``list[u32] | None`` / ``list[int] |
None`` accept.
"""

from __future__ import annotations

import sys
from array import array
from typing import Annotated, Any, Final, Literal

import msgspec

from inferencecache import accelerators
from inferencecache.fingerprint import split_packed
from inferencecache.kvevents.hashes import MASK64


class TokenIds(array):  # type: ignore[type-arg]
    """The token ids of a decoded ``BlockStored``: an ``array('I')`` (4 bytes per id, no Python
    int per id; the fingerprint reads it as a buffer) that compares equal to a list of the same
    ints, so code written against ``list[int]`` keeps working."""

    __slots__ = ()

    def __new__(cls, data: Any = ()) -> TokenIds:
        return super().__new__(cls, "I", data)  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return len(self) == len(other) and self.tolist() == other
        return array.__eq__(self, other)  # type: ignore[no-any-return]

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})"


_U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_TOKENS: Final = msgspec.msgpack.Decoder(list[_U32] | None)
_HASHES: Final = msgspec.msgpack.Decoder(list[int] | None)
_LITTLE: Final = sys.byteorder == "little"


def token_array_py(raw: bytes, /) -> TokenIds | None:
    """A msgpack array of ints in [0, 2^32) (or nil: empty) → ``TokenIds``; else None."""
    try:
        ids = _TOKENS.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return TokenIds(ids or ())


def hash_keys_py(raw: bytes, /) -> list[bytes] | None:
    """A msgpack array of ints (int64 or uint64; or nil: empty) → 8-byte big-endian keys of
    ``value mod 2^64``; else None."""
    try:
        values = _HASHES.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if not values:
        return []
    try:
        arr = array("q", values)  # int64: its two's complement is ``v & MASK64``
    except OverflowError:
        try:
            arr = array("Q", values)
        except OverflowError:  # both ranges in one array
            return [(v & MASK64).to_bytes(8, "big") for v in values]
    if _LITTLE:
        arr.byteswap()
    return split_packed(arr.tobytes())


IMPLEMENTATION: Literal["native", "python"]
_native = accelerators.built("inferencecache.kvevents._native")
if _native is not None:
    _native.set_token_type(TokenIds)  # the build exists: tell it the type it returns
if _native is not None and not accelerators.pure_python_forced("kvevents._native"):
    from inferencecache.kvevents._native import hash_keys, token_array

    IMPLEMENTATION = "native"
else:
    token_array, hash_keys = token_array_py, hash_keys_py
    IMPLEMENTATION = "python"

__all__ = [
    "IMPLEMENTATION",
    "TokenIds",
    "hash_keys",
    "hash_keys_py",
    "token_array",
    "token_array_py",
]
