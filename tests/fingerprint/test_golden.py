"""contract-and-index.md §8.2 golden vectors and §10 item 87, for both implementations and the
public API."""

from __future__ import annotations

from types import ModuleType

import pytest

from inferencecache import fingerprint

from .conftest import oracle

# (tokens, block size, parent, expected prefix hashes in decimal)
GOLDEN = {
    "two_block_chain": (list(range(1, 33)), 16, None, [16863443419780771464, 12466389667045779788]),
    "multi_block_chain": (
        list(range(64)),
        16,
        None,
        [15310707395893867146, 13769157705258532664, 11879827756109914528, 3888788807566526800],
    ),
    "parent_chain": (
        list(range(50, 82)),
        16,
        3735928559,
        [13185224009891017151, 2998384554010166533],
    ),
    "one_block": (list(range(1, 17)), 16, None, [16863443419780771464]),
    "tail_dropped": (list(range(100, 120)), 16, None, [10823191264391160519]),
    "sub_block": (list(range(10)), 16, None, []),
}


@pytest.mark.parametrize("name", GOLDEN)
def test_c10_87_golden_vectors_decimal(impl: ModuleType, name: str) -> None:
    tokens, b, parent, expected = GOLDEN[name]
    assert impl.prefix_hashes(tokens, b, parent) == expected
    assert oracle(tokens, b, parent) == expected  # the test oracle agrees with the spec too


@pytest.mark.parametrize("name", GOLDEN)
def test_c10_87_golden_vectors_big_endian_wire_form(impl: ModuleType, name: str) -> None:
    tokens, b, parent, expected = GOLDEN[name]
    wire = [h.to_bytes(8, "big") for h in expected]
    assert impl.chain_packed(tokens, b, parent) == b"".join(wire)
    hashes, counts = impl.chain(tokens, b, parent)
    assert hashes == wire
    assert counts == [b] * len(wire)
    assert all(type(h) is bytes and len(h) == 8 for h in hashes)


def test_c10_87_first_hash_bytes() -> None:
    assert fingerprint.to_bytes(16863443419780771464).hex() == "ea06fc71a5ee6e88"
    assert fingerprint.chain(list(range(1, 17)), 16) == ([bytes.fromhex("ea06fc71a5ee6e88")], [16])


def test_c10_87_public_api_matches_spec() -> None:
    """`inferencecache.fingerprint` exports the spec's names with the spec's results."""
    tokens, b, _, expected = GOLDEN["two_block_chain"]
    assert fingerprint.prefix_hashes(tokens, b) == expected
    assert fingerprint.chain(tokens, b) == ([fingerprint.to_bytes(h) for h in expected], [16, 16])
    assert fingerprint.IMPLEMENTATION in ("native", "python")


@pytest.mark.parametrize("extra", range(16))
def test_c10_87_partial_tail_never_changes_result(impl: ModuleType, extra: int) -> None:
    base = list(range(1, 33))
    tail = list(range(900, 900 + extra))
    assert impl.prefix_hashes(base + tail, 16) == GOLDEN["two_block_chain"][3]
    assert impl.chain_packed(base + tail, 16) == impl.chain_packed(base, 16)


@pytest.mark.parametrize("block_size", [0, -1, -16, -(2**70)])
def test_c10_87_non_positive_block_size_yields_nothing(impl: ModuleType, block_size: int) -> None:
    tokens = list(range(64))
    assert impl.prefix_hashes(tokens, block_size) == []
    assert impl.chain_packed(tokens, block_size) == b""
    assert impl.chain(tokens, block_size) == ([], [])
    assert impl.prefix_hashes(tokens, block_size, parent=7) == []


@pytest.mark.parametrize("n", [0, 1, 15])
def test_c10_87_sub_block_input_yields_nothing(impl: ModuleType, n: int) -> None:
    tokens = list(range(n))
    assert impl.prefix_hashes(tokens, 16) == []
    assert impl.chain_packed(tokens, 16) == b""
    assert impl.chain(tokens, 16) == ([], [])
    assert impl.prefix_hashes(tokens, 16, parent=3735928559) == []
