"""Both fingerprint implementations, as one parametrized fixture, and a spec-level oracle."""

from __future__ import annotations

import struct
from types import ModuleType

import pytest
import xxhash

from inferencecache import accelerators
from inferencecache.fingerprint import pure

SEED = 1337


NATIVE = accelerators.built("inferencecache.fingerprint._native")
IMPLS = [
    pytest.param(pure, id="python"),
    pytest.param(
        NATIVE,
        id="native",
        marks=pytest.mark.skipif(NATIVE is None, reason="C accelerator not built"),
    ),
]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """`pure` or `_native`: every API function exists with the same signature in both."""
    module: ModuleType = request.param
    return module


def oracle(tokens: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """contract-and-index.md §8.1 written out literally, one block at a time (slow, obviously
    right)."""
    out: list[int] = []
    if block_size <= 0:
        return out
    prev = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        content = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=SEED)
        if prev is None:
            prev = content
        else:
            prev = xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, content), seed=SEED)
        out.append(prev)
    return out


