"""Encoders write the exact wire shape of a release: every fixture re-encodes byte for byte."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferencecache.kvevents import BlockRemoved, BlockStored, decode_batch
from inferencecache.kvevents.encode import (
    FORMATS,
    WireAllCleared,
    WireEvent,
    WireFormat,
    WireRemoved,
    WireStored,
    encode_batch,
    wire_format,
)
from tests.kvevents.util import entries, payload

FAMILY_FORMAT = {
    "vllm-map-v0.33": "vllm-0.33",
    "vllm-array-v0.22": "vllm-0.22",
    "vllm-array-v0.9": "vllm-0.9",
    "sglang-map-v0.5.23": "sglang-0.5.23",
    "sglang-array-v0.5.18": "sglang-0.5.18",
}


def _value(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"bin_hex"}:
        return bytes.fromhex(v["bin_hex"])
    if isinstance(v, list):
        return [_value(x) for x in v]
    return v


def _wire(raw: Any, fmt: WireFormat) -> WireEvent:
    if isinstance(raw, dict):
        tag = raw["type"]
        fields = {k: _value(v) for k, v in raw.items() if k != "type"}
    else:
        tag = raw[0]
        names = fmt.stored_fields if tag == "BlockStored" else fmt.removed_fields
        fields = {n: _value(v) for n, v in zip(names, raw[1:], strict=False)}
    if tag == "BlockStored":
        return WireStored(**fields)
    if tag == "BlockRemoved":
        return WireRemoved(**fields)
    assert tag == "AllBlocksCleared"
    return WireAllCleared()


CASES = [
    f for f in entries()
    if f["expect"] == "ok" and f["family"] in FAMILY_FORMAT
]


@pytest.mark.parametrize("f", CASES, ids=[f["file"] for f in CASES])
def test_every_well_formed_fixture_reencodes_byte_for_byte(f: dict[str, Any]) -> None:
    fmt = wire_format(FAMILY_FORMAT[f["family"]])
    ts, events, *rest = f["decoded"]
    wire = [_wire(e, fmt) for e in events]
    data = encode_batch(ts, wire, fmt, rank=rest[0] if rest else 0)
    assert data == payload(f["file"])


def test_v09_format_writes_the_origin_shape() -> None:
    data = encode_batch(0.0, [WireStored([0xE000], None, list(range(16)), 16)], "vllm-0.9")
    assert msgspec.msgpack.decode(data) == [0.0, [["BlockStored", [0xE000], None,
                                                   list(range(16)), 16, None]]]


def test_array_lengths_identify_the_release_line() -> None:
    ev = WireStored([1], None, list(range(16)), 16, medium="GPU")
    rm = WireRemoved([1], medium="GPU", group_idx=0)
    want = {"vllm-0.9": (6, 2), "vllm-0.10.2": (7, 3), "vllm-0.14": (8, 3), "vllm-0.17": (9, 3),
            "vllm-0.20": (10, 4), "vllm-0.22": (12, 4), "sglang-0.5.18": (7, 3)}
    for name, (stored_len, removed_len) in want.items():
        obj = msgspec.msgpack.decode(encode_batch(1.0, [ev, rm], name))
        assert (len(obj[1][0]), len(obj[1][1])) == (stored_len, removed_len), name


def test_maps_omit_defaulted_nil_fields_but_write_required_ones() -> None:
    ev = WireStored([1], None, list(range(16)), 16)
    obj = msgspec.msgpack.decode(encode_batch(1.0, [ev, WireRemoved([1])], "vllm-0.33"))
    assert obj[1][0] == {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                         "token_ids": list(range(16)), "block_size": 16, "lora_id": None,
                         "medium": None, "lora_name": None}
    assert obj[1][1] == {"type": "BlockRemoved", "block_hashes": [1], "medium": None}
    sgl = msgspec.msgpack.decode(encode_batch(1.0, [ev, WireRemoved([1])], "sglang-0.5.23"))
    assert "medium" not in sgl[1][0] and sgl[1][0]["lora_id"] is None
    assert sgl[1][1] == {"type": "BlockRemoved", "block_hashes": [1]}


def test_sglang_0518_salted_store_gets_an_eighth_slot() -> None:
    ev = WireStored([-5], None, list(range(16)), 16, medium="GPU", cache_salt="s1")
    obj = msgspec.msgpack.decode(encode_batch(1.0, [ev], "sglang-0.5.18"))
    assert obj[1][0][7] == {"cache_salt": "s1"} and len(obj[1][0]) == 8


def test_replay_generation_per_format() -> None:
    assert not FORMATS["vllm-0.9"].replay_topic_frame
    assert not FORMATS["vllm-0.24"].replay_topic_frame
    assert FORMATS["vllm-0.26"].replay_topic_frame and FORMATS["vllm-0.33"].replay_topic_frame
    assert FORMATS["sglang-0.5.23"].replay_topic_frame
    with pytest.raises(ValueError):
        wire_format("vllm-9.9")


hashes = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=32, max_size=32))


@settings(max_examples=150)
@given(
    st.sampled_from(sorted(FORMATS)),
    st.lists(hashes, min_size=1, max_size=4),
    st.one_of(st.none(), hashes),
    st.sampled_from([None, 0, 3]),
    st.sampled_from([None, "sql-lora"]),
)
def test_encode_then_decode_round_trips(
    name: str, hs: list[Any], parent: Any, lora_id: int | None, lora_name: str | None
) -> None:
    fmt = FORMATS[name]
    tokens = list(range(16 * len(hs)))
    ev = WireStored(hs, parent, tokens, 16, lora_id=lora_id, medium="CPU", lora_name=lora_name,
                    group_idx=1, kv_cache_spec_kind="full_attention")
    got = decode_batch(encode_batch(2.5, [ev, WireRemoved(hs, medium="CPU", group_idx=1),
                                          WireAllCleared()], fmt))
    stored, removed, _ = got.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    key = [h if isinstance(h, bytes) else (h % 2**64).to_bytes(8, "big") for h in hs]
    assert stored.block_hashes == key == removed.block_hashes
    assert stored.token_ids == tokens and stored.lora_id == lora_id
    has = set(fmt.stored_fields)
    assert stored.medium == ("CPU" if "medium" in has else None)
    assert stored.lora_name == (lora_name if "lora_name" in has else None)
    assert stored.group_idx == (1 if "group_idx" in has else None)
    assert removed.group_idx == (1 if "group_idx" in fmt.removed_fields else None)
