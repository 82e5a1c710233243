"""Content fingerprint of token ids (contract-and-index.md §8), the one formula every part shares.

XXH3-64 seed 1337 over each full block of `block_size` token ids (4 bytes little-endian each),
chained: `prefix[i] = XXH3(le64(prefix[i-1]) || le64(content[i]))`, so block i's hash names the
whole prefix 0..i. On the wire a hash is 8 bytes big-endian. docs/fingerprint.md has the rules,
the input types each function takes, and measured costs.

Two implementations with identical results: the C accelerator `_native` (used when built) and
the pure-Python twin `pure` (`INFERENCECACHE_PURE_PYTHON=1` forces it). With
`INFERENCECACHE_REQUIRE_NATIVE=1` a missing build is an ImportError here. `IMPLEMENTATION`
says which one is active.
"""

from __future__ import annotations

from typing import Literal

from inferencecache import accelerators

SEED = 1337
"""The frozen XXH3-64 seed of the fingerprint."""

HASH_BYTES = 8
"""Bytes per hash in wire form (big-endian uint64)."""

MAX_U32 = 0xFFFFFFFF
"""Largest token id."""


IMPLEMENTATION: Literal["native", "python"]
if accelerators.load("inferencecache.fingerprint._native") is not None:
    from . import _native as _active

    IMPLEMENTATION = "native"
else:  # same API (tests/fingerprint/test_selection.py compares the signatures)
    from . import pure as _active  # type: ignore[no-redef]

    IMPLEMENTATION = "python"

chain = _active.chain
chain_from_varints = _active.chain_from_varints
chain_packed = _active.chain_packed
decode_varints = _active.decode_varints
prefix_hashes = _active.prefix_hashes
split_packed = _active.split_packed
varint_count = _active.varint_count


def to_bytes(h: int) -> bytes:
    """Wire form of a hash: 8 bytes big-endian (ValueError outside 0..2**64-1)."""
    try:
        return h.to_bytes(8, "big")
    except OverflowError:
        raise ValueError(f"hash {h!r} is outside 0..18446744073709551615") from None


def from_bytes(b: bytes) -> int:
    """Inverse of `to_bytes` (ValueError unless exactly 8 bytes)."""
    if len(b) != HASH_BYTES:
        raise ValueError(f"a hash is {HASH_BYTES} bytes, got {len(b)}")
    return int.from_bytes(b, "big")


__all__ = [
    "HASH_BYTES",
    "IMPLEMENTATION",
    "MAX_U32",
    "SEED",
    "chain",
    "chain_from_varints",
    "chain_packed",
    "decode_varints",
    "from_bytes",
    "prefix_hashes",
    "split_packed",
    "to_bytes",
    "varint_count",
]
