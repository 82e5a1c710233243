"""Token inputs, id validation, parents, continuation across calls, and small helpers."""

from __future__ import annotations

import json
import struct
import sys
from array import array
from pathlib import Path
from types import ModuleType

import pytest

from inferencecache import fingerprint

from .conftest import oracle

TOKENS = [0, 1, 127, 128, 65535, 65536, 2**31, 2**32 - 1] * 8  # 64 ids, 4 blocks of 16
EXPECTED = oracle(TOKENS, 16)
LE32 = struct.pack(f"<{len(TOKENS)}I", *TOKENS)


class Index:
    """An int-like token (numpy scalars and friends behave like this)."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(list, id="list"),
        pytest.param(tuple, id="tuple"),
        pytest.param(lambda t: iter(t), id="iterator"),
        pytest.param(lambda t: (x for x in t), id="generator"),
        pytest.param(lambda t: array("I", t), id="array-I"),
        pytest.param(lambda t: array("q", t), id="array-q"),
        pytest.param(lambda t: array("L", t), id="array-L"),
        pytest.param(lambda t: memoryview(array("I", t)), id="memoryview-I"),
        pytest.param(lambda t: LE32, id="bytes-le32"),
        pytest.param(lambda t: bytearray(LE32), id="bytearray-le32"),
        pytest.param(lambda t: memoryview(LE32), id="memoryview-le32"),
        pytest.param(lambda t: memoryview(LE32).cast("I"), id="memoryview-cast-I"),
        pytest.param(lambda t: [Index(x) for x in t], id="__index__"),
        pytest.param(lambda t: type("L", (list,), {})(t), id="list-subclass"),
    ],
)
def test_every_token_input_type_gives_the_same_chain(impl: ModuleType, make) -> None:
    assert impl.prefix_hashes(make(TOKENS), 16) == EXPECTED
    assert impl.chain_packed(make(TOKENS), 16) == b"".join(h.to_bytes(8, "big") for h in EXPECTED)


def test_range_input(impl: ModuleType) -> None:
    assert impl.prefix_hashes(range(64), 16) == oracle(list(range(64)), 16)


def test_big_endian_typed_buffer_is_read_by_value(impl: ModuleType) -> None:
    """A buffer whose format says big-endian u32 is read by value, not by byte order."""
    be = struct.pack(f">{len(TOKENS)}I", *TOKENS)
    view = memoryview(be).cast("B").cast("I")  # native 'I' view over big-endian bytes...
    if sys.byteorder == "little":
        swapped = array("I", be)
        swapped.byteswap()  # ...so build the expected value the other way round
        assert impl.prefix_hashes(swapped, 16) == EXPECTED
    assert impl.prefix_hashes(view, 16) == oracle(list(view), 16)


def test_byte_buffer_length_must_be_a_multiple_of_4(impl: ModuleType) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        impl.prefix_hashes(LE32 + b"\x00", 16)
    with pytest.raises(ValueError):
        impl.chain_packed(b"\x01\x02\x03", 1)


def test_non_contiguous_token_buffer_is_rejected(impl: ModuleType) -> None:
    with pytest.raises(TypeError, match="contiguous"):
        impl.prefix_hashes(memoryview(LE32)[::2], 1)
    with pytest.raises(TypeError):
        impl.prefix_hashes(memoryview(LE32).cast("B", (len(LE32) // 4, 4)), 1)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**63, 2**64, -(2**70), 2**100])
def test_out_of_range_ids_raise_value_error(impl: ModuleType, bad: int) -> None:
    tokens = [1] * 20 + [bad] + [1] * 11
    for call in (impl.prefix_hashes, impl.chain_packed, impl.chain):
        with pytest.raises(ValueError, match="index 20"):
            call(tokens, 16)
    if -(2**63) <= bad < 2**63:
        with pytest.raises(ValueError):
            impl.prefix_hashes(array("q", tokens), 16)
    with pytest.raises(ValueError):
        impl.prefix_hashes([Index(x) for x in tokens], 16)


def test_ids_in_the_dropped_tail_are_not_looked_at(impl: ModuleType) -> None:
    """Only hashed tokens are validated: a partial tail never changes the result."""
    assert impl.prefix_hashes([*range(16), -1, 2**40, "x"], 16) == oracle(list(range(16)), 16)
    assert impl.prefix_hashes([-1], 16) == []
    assert impl.prefix_hashes([-1, None], 0) == []


@pytest.mark.parametrize("bad", [1.0, "1", None, b"1", object()])
def test_non_integer_ids_raise_type_error(impl: ModuleType, bad: object) -> None:
    with pytest.raises(TypeError):
        impl.prefix_hashes([1] * 5 + [bad] + [1] * 10, 16)


def test_bools_are_ints(impl: ModuleType) -> None:
    """bool is an int subclass: True hashes as 1, False as 0 (documented)."""
    flags = [True, False] * 8
    assert impl.prefix_hashes(flags, 16) == impl.prefix_hashes([1, 0] * 8, 16)
    assert impl.prefix_hashes(list(range(16)), True) == impl.prefix_hashes(list(range(16)), 1)


def test_first_bad_id_decides_the_exception(impl: ModuleType) -> None:
    with pytest.raises(ValueError):
        impl.prefix_hashes([1, -1, 1.5] + [0] * 13, 16)
    with pytest.raises(TypeError):
        impl.prefix_hashes([1, 1.5, -1] + [0] * 13, 16)


def test_unsupported_tokens_argument(impl: ModuleType) -> None:
    with pytest.raises(TypeError):
        impl.prefix_hashes(5, 16)
    with pytest.raises(TypeError):
        impl.prefix_hashes("abcdefghijklmnop", 16)
    with pytest.raises(TypeError):
        impl.prefix_hashes([1] * 16, 16.0)
    with pytest.raises(TypeError):
        impl.prefix_hashes([1] * 16, "16")


def test_list_mutated_by_index_reads_the_ids_as_of_the_call(impl: ModuleType) -> None:
    """An __index__ that empties the caller's list mid-call changes nothing: both twins read
    the ids the list held when the call started (and the C reader must not crash)."""
    tokens: list[object] = list(range(32))

    class Shrinker:
        def __index__(self) -> int:
            del tokens[3:]
            return 2

    tokens[2] = Shrinker()
    assert impl.prefix_hashes(tokens, 16) == oracle(list(range(32)), 16)
    assert len(tokens) == 3


@pytest.mark.parametrize("parent", [0, 1, 3735928559, 2**63, 2**64 - 1])
def test_parent_prefixes_the_chain(impl: ModuleType, parent: int) -> None:
    tokens = list(range(50, 98))
    assert impl.prefix_hashes(tokens, 16, parent) == oracle(tokens, 16, parent)
    assert impl.prefix_hashes(tokens, 16, parent=parent) == oracle(tokens, 16, parent)
    assert impl.prefix_hashes(tokens, 16, parent=None) == oracle(tokens, 16)


@pytest.mark.parametrize("parent", [-1, 2**64, 2**70])
def test_parent_out_of_range(impl: ModuleType, parent: int) -> None:
    with pytest.raises(ValueError):
        impl.prefix_hashes(list(range(16)), 16, parent)
    with pytest.raises(ValueError):
        impl.chain_from_varints(b"\x01", 1, parent)
    with pytest.raises(TypeError):
        impl.prefix_hashes(list(range(16)), 16, "1")


@pytest.mark.parametrize("split_blocks", [0, 1, 2, 5, 8])
def test_continuing_from_a_remembered_parent_equals_rolling_the_whole_prompt(
    impl: ModuleType, split_blocks: int
) -> None:
    """The subscriber keeps the last prefix hash and hashes only the new blocks later."""
    prompt = [(i * 7919) % 150000 for i in range(8 * 16 + 5)]
    whole = impl.prefix_hashes(prompt, 16)
    cut = split_blocks * 16
    first = impl.prefix_hashes(prompt[:cut], 16)
    parent = first[-1] if first else None
    rest = impl.prefix_hashes(prompt[cut:], 16, parent)
    assert first + rest == whole
    packed_rest = impl.chain_packed(prompt[cut:], 16, parent)
    assert impl.chain_packed(prompt[:cut], 16) + packed_rest == impl.chain_packed(prompt, 16)


def test_fixture_stream_chains_across_events(impl: ModuleType) -> None:
    """The vLLM fixture stream: a root event, then a suffix event whose parent is its last
    block. The subscriber's expected fingerprints (manifest) come out of parent=."""
    manifest = json.loads(
        (Path(__file__).parents[1] / "fixtures/vllm_kv_events/manifest.json").read_text()
    )
    files = {f["file"]: f for f in manifest["fixtures"]}
    root = files["vllm-map-v0.33-stream-00-stored-root.bin"]
    suffix = files["vllm-map-v0.33-stream-01-stored-suffix.bin"]
    root_tokens = root["decoded"][1][0]["token_ids"]
    suffix_tokens = suffix["decoded"][1][0]["token_ids"]
    want_root = [e["prefix_hash"] for e in root["expected"][0]["report"]]
    want_suffix = [e["prefix_hash"] for e in suffix["expected"][0]["report"]]

    root_hashes = impl.prefix_hashes(root_tokens, 16)
    assert [h.to_bytes(8, "big").hex() for h in root_hashes] == want_root
    got = impl.chain_packed(suffix_tokens, 16, parent=root_hashes[-1])
    assert got.hex() == "".join(want_suffix)
    assert impl.chain_packed(root_tokens + suffix_tokens, 16).hex() == "".join(
        want_root + want_suffix
    )


@pytest.mark.parametrize(
    "block_size", [1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 59, 60, 61, 64, 65, 300]
)
def test_block_sizes_across_xxh3_length_classes(impl: ModuleType, block_size: int) -> None:
    """B=1..4 hit the 4-16 byte classes, 5..32 the 17-128 one, 33..60 129-240, 61+ the long one."""
    tokens = [(i * 2654435761) % 2**32 for i in range(block_size * 3 + 1)]
    assert impl.prefix_hashes(tokens, block_size) == oracle(tokens, block_size)
    assert impl.prefix_hashes(tokens, block_size, 99) == oracle(tokens, block_size, 99)


def test_large_input_uses_the_released_gil_path(impl: ModuleType) -> None:
    tokens = [(i * 40503) % 200003 for i in range(70_000)]  # > 256 KiB of token bytes
    assert impl.prefix_hashes(tokens, 16) == oracle(tokens, 16)


def test_split_packed(impl: ModuleType) -> None:
    packed = impl.chain_packed(list(range(64)), 16)
    parts = impl.split_packed(packed)
    assert parts == impl.chain(list(range(64)), 16)[0]
    assert impl.split_packed(b"") == []
    assert impl.split_packed(memoryview(packed)) == parts
    assert impl.split_packed(bytearray(packed)) == parts
    with pytest.raises(ValueError, match="multiple of 8"):
        impl.split_packed(packed[:-1])
    with pytest.raises(TypeError):
        impl.split_packed(8)


def test_to_bytes_and_from_bytes() -> None:
    assert fingerprint.to_bytes(0) == bytes(8)
    assert fingerprint.to_bytes(2**64 - 1) == b"\xff" * 8
    assert fingerprint.from_bytes(bytes.fromhex("ea06fc71a5ee6e88")) == 16863443419780771464
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            fingerprint.to_bytes(bad)
    for wrong in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(ValueError):
            fingerprint.from_bytes(wrong)


def test_chain_counts_are_plain_ints(impl: ModuleType) -> None:
    hashes, counts = impl.chain(list(range(40)), True)  # bool block size → 1
    assert counts == [1] * 40 and all(type(c) is int for c in counts)
    assert len(hashes) == 40


def test_keyword_arguments(impl: ModuleType) -> None:
    t = list(range(32))
    assert impl.prefix_hashes(tokens=t, block_size=16) == oracle(t, 16)
    assert impl.chain_packed(t, block_size=16, parent=5) == b"".join(
        h.to_bytes(8, "big") for h in oracle(t, 16, 5)
    )
    with pytest.raises(TypeError):
        impl.prefix_hashes(t)
    with pytest.raises(TypeError):
        impl.prefix_hashes(t, 16, None, 1)
    with pytest.raises(TypeError):
        impl.prefix_hashes(t, 16, bogus=1)
    with pytest.raises(TypeError):
        impl.prefix_hashes(t, 16, block_size=16)
