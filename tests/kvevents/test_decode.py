"""The tolerant decoder against every fixture and the engine-events-and-subscriber.md §3.3 rules
(engine-events-and-subscriber.md §13 1-16, 82)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest

from inferencecache.kvevents import (
    AllBlocksCleared,
    BatchDecoder,
    BatchRejected,
    BlockRemoved,
    BlockStored,
    decode_batch,
    normalize_hash,
)
from inferencecache.kvevents.decode import decode_untyped
from tests.kvevents.util import entries, entry, payload

enc = msgspec.msgpack.Encoder()
DECODERS = [pytest.param(decode_untyped, id="reference"), pytest.param(decode_batch, id="fast")]
H1 = 15111065706836454659  # ≥ 2^63
H2 = 2237775801835219320
TOKENS32 = [128000, 128006, 882, 128007, 271, 3923, 374, 279, 6864, 315, 9822, 30, 128009,
            128006, 78191, 128007, 0, 1, 127, 128, 255, 256, 65535, 65536, 100000, 42, 7, 13, 2,
            3, 5, 11]


def be8(v: int) -> bytes:
    return (v % 2**64).to_bytes(8, "big")


def stored_map(**over: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [H1],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    ev.update(over)
    return ev


def batch(*events: Any, ts: Any = 1.5) -> bytes:
    return enc.encode([ts, list(events), 0])


@pytest.mark.parametrize("name", [f["file"] for f in entries()])
def test_every_fixture_matches_its_sha256_and_documented_outcome(name: str) -> None:
    f = entry(name)
    data = payload(name)
    assert hashlib.sha256(data).hexdigest() == f["sha256"]
    assert len(data) == f["bytes"]
    for dec in (decode_untyped, decode_batch):
        if f["expect"] == "error":
            with pytest.raises(BatchRejected):
                dec(data)
            continue
        got = dec(data)
        decoded = f["decoded"]
        known = [e for e in decoded[1] if _tag(e) in ("BlockStored", "BlockRemoved",
                                                    "AllBlocksCleared")]
        assert len(got.events) == len(known)
        assert got.unknown_events == len(decoded[1]) - len(known)
        assert got.ts == decoded[0]
        for ev, raw in zip(got.events, known, strict=True):
            assert type(ev).__name__ == _tag(raw)
            if not isinstance(ev, AllBlocksCleared):
                assert ev.block_hashes == [_key(h) for h in _field(raw, "block_hashes", 1)]


def _tag(raw: Any) -> str:
    return str(raw["type"] if isinstance(raw, dict) else raw[0])


def _field(raw: Any, name: str, slot: int) -> Any:
    return raw[name] if isinstance(raw, dict) else raw[slot]


def _key(h: Any) -> bytes:
    if isinstance(h, dict):
        return bytes.fromhex(h["bin_hex"])
    return be8(h)


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_01_map_stream_root_store(dec: Any) -> None:
    b = dec(payload("vllm-map-v0.33-stream-00-stored-root.bin"))
    assert b.ts == 1767225600.125
    assert len(b.events) == 1
    ev = b.events[0]
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [be8(H1), be8(H2)]
    assert ev.parent_block_hash is None
    assert ev.token_ids == TOKENS32
    assert ev.block_size == 16
    assert ev.lora_id is None
    assert ev.medium == "GPU"
    assert ev.group_idx == 0 and ev.kv_cache_spec_kind == "full_attention"


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_02_array_v022_is_the_same_logical_store(dec: Any) -> None:
    a = dec(payload("vllm-map-v0.33-stream-00-stored-root.bin")).events[0]
    b = dec(payload("vllm-array-v0.22-stored-full.bin")).events[0]
    assert a == b


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_03_v09_two_slot_envelope_and_negative_hash(dec: Any) -> None:
    b = dec(payload("vllm-array-v0.9-stored-int.bin"))
    ev = b.events[0]
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes[0] == (2**64 - 4206093896457611640).to_bytes(8, "big")
    assert ev.block_hashes[0] == bytes.fromhex("c5a0f3e2d1b49688")
    assert ev.lora_id is None and ev.medium is None


def test_s13_04_hash_at_or_above_2_63_keys_big_endian() -> None:
    assert normalize_hash(0xD1B54A32D192ED03).hex() == "d1b54a32d192ed03"
    assert normalize_hash(-1).hex() == "ffffffffffffffff"
    assert normalize_hash(b"\x01\x02") == b"\x01\x02"
    assert normalize_hash("ab") == b"ab"
    for dec in (decode_untyped, decode_batch):
        ev = dec(batch(stored_map(block_hashes=[0xD1B54A32D192ED03]))).events[0]
        assert isinstance(ev, BlockStored)
        assert ev.block_hashes[0].hex() == "d1b54a32d192ed03"


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_05_bytes_hashes_key_unchanged(dec: Any) -> None:
    f = entry("vllm-map-v0.33-stored-bytes-hashes.bin")
    ev = dec(payload(f["file"])).events[0]
    raw = f["decoded"][1][0]
    assert ev.block_hashes == [bytes.fromhex(h["bin_hex"]) for h in raw["block_hashes"]]
    assert ev.parent_block_hash == bytes.fromhex(raw["parent_block_hash"]["bin_hex"])
    assert all(len(h) == 32 for h in ev.block_hashes)


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_06_synthetic_five_slot_store_has_no_adapter(dec: Any) -> None:
    ev = dec(payload("synthetic-array-stored-5-element.bin")).events[0]
    assert isinstance(ev, BlockStored)
    assert ev.lora_id is None and ev.lora_name is None and ev.block_size == 16


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_07_batch_mixing_arrays_and_maps_decodes_in_order(dec: Any) -> None:
    data = batch(
        ["BlockStored", [1], None, list(range(16)), 16, None, "GPU"],
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        ["AllBlocksCleared"],
        stored_map(block_hashes=[2]),
    )
    b = dec(data)
    assert [type(e) for e in b.events] == [BlockStored, BlockRemoved, AllBlocksCleared,
                                           BlockStored]
    assert b.events[0].block_hashes == [be8(1)]  # type: ignore[union-attr]
    assert b.events[3].block_hashes == [be8(2)]  # type: ignore[union-attr]


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_08_unknown_map_keys_and_extra_array_slots_are_ignored(dec: Any) -> None:
    data = batch(
        stored_map(future_field={"x": [1, 2]}, another=7),
        ["BlockStored", [1], None, list(range(16)), 16, None, "GPU", None, None, 0,
         "full_attention", None, "slot12", {"slot": 13}],
        ["BlockRemoved", [1], "GPU", 0, "extra"],
        ["AllBlocksCleared", "extra"],
        {"type": "AllBlocksCleared", "why": "reset"},
    )
    b = dec(data)
    assert len(b.events) == 5
    assert b.events[1].kv_cache_spec_kind == "full_attention"  # type: ignore[union-attr]


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_09_unknown_event_type_is_skipped_the_rest_applies(dec: Any) -> None:
    b = dec(payload("vllm-map-v0.33-unknown-event-type.bin"))
    assert [type(e) for e in b.events] == [BlockStored, AllBlocksCleared]
    assert b.unknown_events == 1


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("malformed-truncated.bin", "msgpack"),
        ("malformed-not-msgpack.bin", "msgpack"),
        ("malformed-envelope-short.bin", "envelope"),
    ],
)
def test_s13_10_truncated_garbage_and_short_envelope_are_rejected(
    dec: Any, name: str, reason: str
) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(payload(name))
    assert e.value.reason == reason


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize("name", ["malformed-tag-not-string.bin", "malformed-map-missing-type.bin"])
def test_s13_11_bad_tags_are_rejected(dec: Any, name: str) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(payload(name))
    assert e.value.reason == "event"


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize(
    "name", ["malformed-lora-id-wrong-type-array.bin", "malformed-lora-id-wrong-type-map.bin"]
)
def test_s13_12_wrong_lora_id_type_rejects_the_whole_batch(dec: Any, name: str) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(payload(name))
    assert e.value.reason == "lora_id"
    # Even when a valid event comes first, nothing of the batch survives.
    with pytest.raises(BatchRejected):
        dec(batch(stored_map(), stored_map(lora_id="sql-lora")))


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize(
    "lora_id", [1.0, True, [1], {"a": 1}, 2**63, "1"], ids=repr
)
def test_lora_id_rules(dec: Any, lora_id: Any) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(batch(stored_map(lora_id=lora_id)))
    assert e.value.reason == "lora_id"
    assert dec(batch(stored_map(lora_id=2**63 - 1))).events[0].lora_id == 2**63 - 1
    assert dec(batch(stored_map(lora_id=-(2**63)))).events[0].lora_id == -(2**63)


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize(
    ("name", "reason"),
    [("malformed-block-size-zero.bin", "block_size"), ("malformed-nil-block-hash.bin",
                                                        "block_hashes")],
)
def test_s13_13_block_size_zero_and_nil_hash_are_rejected(dec: Any, name: str, reason: str) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(payload(name))
    assert e.value.reason == reason


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_14_store_array_with_tag_and_three_fields_is_rejected(dec: Any) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(batch(["BlockStored", [1], None, list(range(16))]))
    assert e.value.reason == "event"


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize("bad", [-1, 2**32, 2**63, 1.0, None, "1"], ids=repr)
def test_s13_15_token_id_out_of_range_or_type_rejects(dec: Any, bad: Any) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(batch(stored_map(token_ids=[*range(15), bad])))
    assert e.value.reason == "token_ids"
    assert dec(batch(stored_map(token_ids=[2**32 - 1] * 16))).events[0].token_ids[0] == 2**32 - 1


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize(
    "ev",
    [
        stored_map(block_hashes=[True]),
        stored_map(block_size=True),
        stored_map(token_ids=[True, *range(15)]),
        stored_map(lora_id=True),
        stored_map(parent_block_hash=False),
        ["BlockStored", [1], None, list(range(16)), True],
    ],
    ids=["hash", "block_size", "token", "lora_id", "parent", "array-block_size"],
)
def test_s13_82_msgpack_true_is_never_an_int(dec: Any, ev: Any) -> None:
    with pytest.raises(BatchRejected):
        dec(batch(ev))


@pytest.mark.parametrize("dec", DECODERS)
def test_s13_82_bool_ts_rejects(dec: Any) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(batch(stored_map(), ts=True))
    assert e.value.reason == "envelope"


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize(
    "data",
    [
        enc.encode(None),
        enc.encode("x"),
        enc.encode([1.0]),
        enc.encode([None, []]),
        enc.encode(["1", []]),
        enc.encode([1.0, None]),
        enc.encode([1.0, {"a": 1}]),
        enc.encode({"ts": 1.0}),
        enc.encode({"events": []}),
    ],
)
def test_envelope_rules(dec: Any, data: bytes) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(data)
    assert e.value.reason == "envelope"


@pytest.mark.parametrize("dec", DECODERS)
def test_map_envelope_and_int_ts_are_accepted(dec: Any) -> None:
    b = dec(enc.encode({"ts": 7, "events": [stored_map()], "data_parallel_rank": 0}))
    assert b.ts == 7.0 and len(b.events) == 1
    assert dec(enc.encode([3, []])).ts == 3.0


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize("ev", [None, 5, "BlockStored", [], {"type": 5}, [None]], ids=repr)
def test_event_shape_rules(dec: Any, ev: Any) -> None:
    with pytest.raises(BatchRejected) as e:
        dec(batch(ev))
    assert e.value.reason == "event"


@pytest.mark.parametrize("dec", DECODERS)
def test_required_map_fields(dec: Any) -> None:
    for missing in ("block_hashes", "token_ids", "block_size"):
        ev = stored_map()
        del ev[missing]
        with pytest.raises(BatchRejected):
            dec(batch(ev))
    ev = stored_map()
    del ev["parent_block_hash"], ev["lora_id"], ev["medium"], ev["lora_name"]
    got = dec(batch(ev)).events[0]
    assert got.parent_block_hash is None and got.lora_id is None
    with pytest.raises(BatchRejected):
        dec(batch({"type": "BlockRemoved", "medium": "GPU"}))
    with pytest.raises(BatchRejected):
        dec(batch(["BlockRemoved"]))


@pytest.mark.parametrize("dec", DECODERS)
def test_nil_hashes_and_nil_tokens_read_as_empty(dec: Any) -> None:
    ev = dec(batch(stored_map(block_hashes=None, token_ids=None))).events[0]
    assert ev.block_hashes == [] and ev.token_ids == []
    rm = dec(batch({"type": "BlockRemoved", "block_hashes": None, "medium": "GPU"})).events[0]
    assert rm.block_hashes == []


@pytest.mark.parametrize("dec", DECODERS)
@pytest.mark.parametrize(
    ("field", "value"),
    [("medium", 5), ("lora_name", {"cache_salt": "s"}), ("group_idx", "0"),
     ("kv_cache_spec_kind", 1), ("group_idx", True)],
)
def test_optional_fields_of_the_wrong_type_read_as_absent_and_are_counted(
    dec: Any, field: str, value: Any
) -> None:
    b = dec(batch(stored_map(**{field: value})))
    assert getattr(b.events[0], field) is None
    assert b.ignored_fields == [field]


@pytest.mark.parametrize("dec", DECODERS)
def test_sglang_salted_eighth_slot_is_not_a_lora_name(dec: Any) -> None:
    ev = ["BlockStored", [-5], None, list(range(16)), 16, None, "GPU", {"cache_salt": "abc"}]
    b = dec(batch(ev))
    assert b.events[0].lora_name is None  # type: ignore[union-attr]
    assert b.events[0].block_hashes == [be8(-5)]  # type: ignore[union-attr]
    assert b.ignored_fields == ["lora_name"]


@pytest.mark.parametrize("dec", DECODERS)
def test_connector_placeholder_block_size_zero_is_accepted(dec: Any) -> None:
    ph = {"type": "BlockStored", "block_hashes": [H1], "parent_block_hash": None,
          "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU",
          "lora_name": None, "group_idx": 0}
    ev = dec(batch(ph)).events[0]
    assert ev.block_size == 0 and ev.token_ids == [] and ev.medium == "CPU"
    for bad in ({**ph, "medium": "GPU"}, {**ph, "medium": "gpu"}, {**ph, "medium": None},
                {**ph, "token_ids": [1]}, {**ph, "block_size": -1}):
        with pytest.raises(BatchRejected) as e:
            dec(batch(bad))
        assert e.value.reason == "block_size"
    with pytest.raises(BatchRejected):
        dec(batch(stored_map(block_size=2**31)))
    assert dec(batch(stored_map(block_size=2**31 - 1, token_ids=[]))).events[0].block_size == (
        2**31 - 1
    )


@pytest.mark.parametrize("dec", DECODERS)
def test_bigram_tokens_are_flagged_not_rejected(dec: Any) -> None:
    b = dec(batch(stored_map(token_ids=[[1, 2]] * 16), stored_map(block_hashes=[9])))
    assert b.events[0].bigram and b.events[0].token_ids == []  # type: ignore[union-attr]
    assert not b.events[1].bigram  # type: ignore[union-attr]


def test_fast_decoder_adapts_to_the_last_shape() -> None:
    d = BatchDecoder()
    arr = payload("vllm-array-v0.22-stored-full.bin")
    mp = payload("vllm-map-v0.33-stream-00-stored-root.bin")
    assert d.decode(arr).events == d.decode(mp).events == d.decode(arr).events
