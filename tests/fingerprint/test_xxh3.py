"""The C XXH3-64 (written from the xxHash specification) against the `xxhash` package."""

from __future__ import annotations

import random

import pytest
import xxhash

from inferencecache.fingerprint import pure

from .conftest import NATIVE

pytestmark = pytest.mark.skipif(NATIVE is None, reason="C accelerator not built")

SEEDS = [0, 1, 1337, 2**32 - 1, 2**63, 2**64 - 1, 0x9E3779B185EBCA87]
# Around each length-class edge: 0 | 1-3 | 4-8 | 9-16 | 17-128 | 129-240 | >240, and around
# the long path's stripe (64 B) and block (1024 B) edges.
EDGES = sorted(
    {
        n + d
        for n in (0, 3, 8, 16, 128, 240, 1024, 2048, 4096, 16384)
        for d in (-2, -1, 0, 1, 2)
        if n + d >= 0
    }
    | {n + d for n in range(256, 4200, 64) for d in (-1, 0, 1)}
    | {65536, 65537, 100_003, 1 << 18, (1 << 18) + 7}
)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_length_up_to_2048(seed: int) -> None:
    assert NATIVE is not None
    rnd = random.Random(seed)
    data = rnd.randbytes(2048 + 64)
    for n in range(2049):
        for off in (0, 3):  # unaligned starts too
            chunk = data[off : off + n]
            assert NATIVE.xxh3_64(chunk, seed) == xxhash.xxh3_64_intdigest(chunk, seed), (n, off)


@pytest.mark.parametrize("seed", SEEDS)
def test_length_class_edges(seed: int) -> None:
    assert NATIVE is not None
    rnd = random.Random(seed ^ 0xABCDEF)
    for n in EDGES:
        for data in (rnd.randbytes(n), b"\x00" * n, b"\xff" * n):
            assert NATIVE.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed), n


def test_default_seed_and_keyword_and_buffers() -> None:
    assert NATIVE is not None
    data = bytes(range(200))
    assert NATIVE.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)
    assert NATIVE.xxh3_64(data=data, seed=1337) == xxhash.xxh3_64_intdigest(data, seed=1337)
    assert NATIVE.xxh3_64(memoryview(data)[7:], 5) == xxhash.xxh3_64_intdigest(data[7:], seed=5)
    assert NATIVE.xxh3_64(bytearray(data), 5) == pure.xxh3_64(bytearray(data), 5)
    with pytest.raises(ValueError):
        NATIVE.xxh3_64(data, -1)
    with pytest.raises(ValueError):
        NATIVE.xxh3_64(data, 2**64)
    with pytest.raises(TypeError):
        NATIVE.xxh3_64("text")


def test_random_lengths_and_seeds() -> None:
    assert NATIVE is not None
    rnd = random.Random(1)
    for _ in range(3000):
        n = rnd.choice([rnd.randrange(300), rnd.randrange(5000)])
        seed = rnd.getrandbits(64)
        data = rnd.randbytes(n)
        assert NATIVE.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed), (n, seed)
