"""Protobuf base-128 varints, written by hand where building a protobuf object costs too much.

The one encoder every hand-written wire path shares (the ingest encoder's twin, the subscriber's
message head, the LookupRoute parser's re-wraps, the tests' payloads). A value is taken modulo
2**64 first, as protobuf writes a negative ``int32``/``int64``. Reading them back is the
fingerprint's ``decode_varints`` (compiled, validated).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

U64: Final = (1 << 64) - 1


def put(out: bytearray, v: int) -> None:
    """Append the varint of ``v`` to ``out``."""
    v &= U64
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def encode(v: int) -> bytes:
    """The varint of ``v``."""
    out = bytearray()
    put(out, v)
    return bytes(out)


def encode_all(values: Iterable[int]) -> bytes:
    """The packed ``repeated`` payload of ``values``: their varints, back to back."""
    out = bytearray()
    for v in values:
        put(out, v)
    return bytes(out)
