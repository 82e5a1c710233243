"""Block → fingerprint mapping, LoRA identity and tiers
(engine-events-and-subscriber.md §3.4, §5, §6, §13)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferencecache.fingerprint import chain_packed, prefix_hashes, split_packed
from inferencecache.kvevents import decode_batch
from inferencecache.kvevents.encode import (
    WireAllCleared,
    WireEvent,
    WireRemoved,
    WireStored,
    encode_batch,
)
from inferencecache.subscriber.messages import build_event, build_update
from inferencecache.subscriber.tiers import T1, T2
from tests.kvevents.util import entries, payload
from tests.subscriber.conftest import MapperKit, entry_json, event_results

TS = 1767225600.125
TS_US = 1767225600125000


def run(kit: MapperKit, *events: WireEvent, fmt: str = "vllm-0.33", ts: float = TS) -> None:
    kit.mapper.apply(decode_batch(encode_batch(ts, list(events), fmt)))


def store(hashes: list[Any], tokens: list[int], parent: Any = None, **kw: Any) -> WireStored:
    kw.setdefault("medium", "GPU")
    return WireStored(hashes, parent, tokens, kw.pop("block_size", 16), **kw)


def fp(tokens: list[int], bs: int = 16) -> list[str]:
    return [h.to_bytes(8, "big").hex() for h in prefix_hashes(tokens, bs)]


def adds(kit: MapperKit) -> list[dict[str, Any]]:
    return [entry_json(e) for e in kit.outbox.added()]


def warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING]


# ---- fixtures against the manifest ---------------------------------------------------------

SINGLE = [
    f for f in entries()
    if f["expect"] != "error" and "stream" not in f and "expected" in f
]


@pytest.mark.parametrize("f", SINGLE, ids=[f["file"] for f in SINGLE])
def test_fixture_expected_outcome(f: dict[str, Any]) -> None:
    kit = MapperKit()
    got = event_results(kit.mapper, kit.outbox, decode_batch(payload(f["file"])))
    want = [{k: v for k, v in e.items() if k not in ("reason",)} for e in f["expected"]
            if "with_flags" not in e]
    assert got == want


def test_s13_24_stream_fixtures_in_seq_order() -> None:
    kit = MapperKit()
    stream = sorted((f for f in entries() if f.get("stream") == "vllm-map"),
                    key=lambda f: f["zmq_frames"]["seq"])
    assert [f["zmq_frames"]["seq"] for f in stream] == [0, 1, 2, 3]
    results = []
    for f in stream:
        results += event_results(kit.mapper, kit.outbox, decode_batch(payload(f["file"])))
        assert results[-len(f["expected"]):] == f["expected"]
    assert [e["prefix_hash"] for e in results[0]["report"]] == ["d6d4b41ea7e2c328",
                                                                 "e1e4f63b48a465cb"]
    assert [e["token_count"] for e in results[0]["report"]] == [16, 32]
    assert results[1]["report"] == [{"prefix_hash": "48173d8f90a870d3", "token_count": 48,
                                     "adapter_id": "", "tier": "T1"}]
    assert results[2]["evict"] == [{"prefix_hash": "48173d8f90a870d3", "adapter_id": ""}]
    assert results[3] == {"event": "AllBlocksCleared", "publish": "ALL_CLEARED"}
    assert kit.mapper.block_count() == 0


# ---- chaining --------------------------------------------------------------------------------


def test_s13_25_two_chained_events_equal_the_concatenation(kit: MapperKit) -> None:
    tokens = list(range(1000, 1064))
    run(kit, store([1, 2], tokens[:32]), store([3, 4], tokens[32:], parent=2))
    assert [e["prefix_hash"] for e in adds(kit)] == fp(tokens)
    assert [e["token_count"] for e in adds(kit)] == [16, 32, 48, 64]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(0, 2**32 - 1))
def test_chaining_across_any_split_equals_fingerprinting_the_whole(
    split: list[int], base: int
) -> None:
    kit = MapperKit()
    total = sum(split)
    tokens = [(base + i * 7919) % 2**32 for i in range(total * 16)]
    parent = None
    block = 0
    for n in split:
        hashes = list(range(block + 1, block + n + 1))
        run(kit, store(hashes, tokens[block * 16 : (block + n) * 16], parent=parent))
        parent = hashes[-1]
        block += n
    assert [e["prefix_hash"] for e in adds(kit)] == fp(tokens)
    assert [e["token_count"] for e in adds(kit)] == [16 * (i + 1) for i in range(total)]


def test_s13_26_unknown_parent_starts_a_fresh_chain(kit: MapperKit) -> None:
    run(kit, store([7], list(range(16)), parent=0xDEAD))
    assert adds(kit) == [{"prefix_hash": fp(list(range(16)))[0], "token_count": 16,
                          "adapter_id": "", "tier": "T1"}]


def test_s13_27_token_mismatch_warns_with_the_three_counts(
    kit: MapperKit, caplog: pytest.LogCaptureFixture
) -> None:
    kit.mapper.apply(decode_batch(payload("vllm-map-v0.33-token-mismatch.bin")))
    assert kit.outbox.added() == []
    w = warnings(caplog)
    assert len(w) == 1
    assert w[0].getMessage() == ("BlockStored produced no index entries (missing or mismatched "
                                 "token_ids)")
    assert (w[0].block_hashes, w[0].token_ids, w[0].block_size) == (2, 16, 16)  # type: ignore[attr-defined]


@pytest.mark.parametrize("medium", ["GPU", None])
def test_s13_28_store_without_token_ids_warns_and_adds_nothing(
    kit: MapperKit, caplog: pytest.LogCaptureFixture, medium: str | None
) -> None:
    run(kit, WireStored([0xE000, 0xE001], None, None, 16, medium=medium))
    assert kit.outbox.added() == []
    assert len(warnings(caplog)) == 1


def test_s13_29_one_entry_per_block_cumulative_counts_no_chain_fields(kit: MapperKit) -> None:
    run(kit, store([1, 2, 3], list(range(48))))
    entries_ = kit.outbox.added()
    assert [e[1] for e in entries_] == [16, 32, 48]
    update = build_update(_ident(), entries_, 5)
    assert len(update.prefixes) == 3
    for p, e in zip(update.prefixes, entries_, strict=True):
        assert p.prefix_hash == e[0] and p.token_count == e[1]
        assert list(p.block_hashes) == [] and list(p.block_token_counts) == []
        assert p.tier == T1  # s13_40: written explicitly
    assert update.adapter_id == ""


def _ident() -> Any:
    from inferencecache.subscriber.messages import Identity

    return Identity("r0", "m", "default", "vllm")


def test_s13_30_restoring_a_known_hash_rereports_the_same_prefix(kit: MapperKit) -> None:
    run(kit, store([1], list(range(16))))
    run(kit, store([1], list(range(16))))
    a = adds(kit)
    assert len(a) == 2 and a[0] == a[1]
    assert kit.mapper.block_count() == 1


def test_s13_31_sglang_partial_page_is_ignored(kit: MapperKit) -> None:
    kit.mapper.apply(decode_batch(payload("sglang-map-v0.5.23-stored-pages.bin")))
    assert [e["prefix_hash"] for e in adds(kit)] == ["d6d4b41ea7e2c328"]
    assert kit.value("events_ignored_total", reason="block_size") == 1


def test_s13_32_only_the_full_attention_group_is_indexed(kit: MapperKit) -> None:
    kit.mapper.apply(decode_batch(payload("vllm-map-v0.33-hybrid-groups.bin")))
    assert [e["prefix_hash"] for e in adds(kit)] == ["d6d4b41ea7e2c328"]
    assert kit.value("events_ignored_total", reason="group") == 1
    assert kit.mapper.lookup((15111065706836454659).to_bytes(8, "big"), group=1) is None


# ---- LoRA --------------------------------------------------------------------------------------


def test_s13_33_no_lora_is_the_default_partition(kit: MapperKit) -> None:
    run(kit, store([1], list(range(16))))
    assert adds(kit)[0]["adapter_id"] == ""


def test_s13_34_mapped_lora_id_same_prefix_as_base(kit: MapperKit) -> None:
    kit.mapper.apply(decode_batch(payload("vllm-map-v0.33-stored-lora.bin")))
    kit.mapper.apply(decode_batch(payload("vllm-map-v0.33-dp-rank-1.bin")))  # base, same tokens
    a = adds(kit)
    assert [e["adapter_id"] for e in a] == ["sql-lora", ""]
    assert a[0]["prefix_hash"] == a[1]["prefix_hash"] == "d6d4b41ea7e2c328"


def test_s13_35_unmapped_lora_id_uses_lora_name_by_default(kit: MapperKit) -> None:
    kit.mapper.apply(decode_batch(payload("vllm-map-v0.33-stored-lora-unmapped.bin")))
    assert adds(kit) == [{"prefix_hash": "0387790d24ef2253", "token_count": 16,
                          "adapter_id": "tenant-x", "tier": "T1"}]


def test_s13_35_unmapped_lora_id_is_dropped_without_trust(caplog: pytest.LogCaptureFixture) -> None:
    kit = MapperKit(trust_lora_name=False)
    data = payload("vllm-map-v0.33-stored-lora-unmapped.bin")
    kit.mapper.apply(decode_batch(data))
    assert kit.outbox.added() == []
    assert len(warnings(caplog)) == 1
    kit.mapper.apply(decode_batch(data))
    assert kit.outbox.added() == [] and len(warnings(caplog)) == 1  # warned once per id
    assert kit.value("lora_drops_total") == 2


@pytest.mark.parametrize("trust", [True, False])
def test_s13_35_lora_id_without_map_entry_or_name_is_always_dropped(
    trust: bool, caplog: pytest.LogCaptureFixture
) -> None:
    kit = MapperKit(names={}, trust_lora_name=trust)
    kit.mapper.apply(decode_batch(payload("vllm-array-v0.9-stored-lora.bin")))
    assert kit.outbox.added() == []
    assert len(warnings(caplog)) == 1


def test_s13_38_eviction_names_the_stored_blocks_adapter(kit: MapperKit) -> None:
    run(kit, store([1], list(range(16)), lora_id=1, lora_name="sql-lora"))
    run(kit, WireRemoved([1], medium="GPU"))
    evicts = [c for c in kit.outbox.calls if c[0] == "evict"]
    assert [(c[1].hex(), c[2]) for c in evicts] == [(fp(list(range(16)))[0], "sql-lora")]
    ev = build_event(_ident(), 2, 1, evicts[0][1], evicts[0][2])
    assert ev.adapter_id == "sql-lora" and ev.prefix_hash == evicts[0][1]
    update = build_update(_ident(), kit.outbox.added(), 1)
    assert update.adapter_id == "" and update.prefixes[0].adapter_id == "sql-lora"


def test_s13_39_same_tokens_two_adapters_never_alias(kit: MapperKit) -> None:
    tokens = list(range(16))
    run(kit, store([10], tokens, lora_id=1, lora_name="sql-lora"),
        store([20], tokens, lora_id=2, lora_name="chat-lora"))
    a = adds(kit)
    assert [e["adapter_id"] for e in a] == ["sql-lora", "chat-lora"]
    assert a[0]["prefix_hash"] == a[1]["prefix_hash"]
    kit.outbox.take()
    run(kit, WireRemoved([20], medium="GPU"))
    evicts = [c for c in kit.outbox.calls if c[0] == "evict"]
    assert [c[2] for c in evicts] == ["chat-lora"]
    assert kit.mapper.lookup((10).to_bytes(8, "big")) is not None


def test_s13_84_lora_name_without_id(caplog: pytest.LogCaptureFixture) -> None:
    strict = MapperKit(trust_lora_name=False)
    run(strict, store([1], list(range(16)), lora_name="x"), fmt="sglang-0.5.23")
    assert strict.outbox.added() == [] and len(warnings(caplog)) == 1
    run(strict, store([1], list(range(16)), lora_name="x"), fmt="sglang-0.5.23")
    assert len(warnings(caplog)) == 1  # once per name
    default = MapperKit()
    run(default, store([1], list(range(16)), lora_name="x"), fmt="sglang-0.5.23")
    assert adds(default)[0]["adapter_id"] == "x"


# ---- tiers and removals ------------------------------------------------------------------------


def test_s13_40_gpu_stores_are_t1_explicitly(kit: MapperKit) -> None:
    run(kit, store([1], list(range(16))), store([2], list(range(16, 32)), medium="gpu"))
    assert {e[3] for e in kit.outbox.added()} == {T1}
    data = build_update(_ident(), kit.outbox.added(), 0).SerializeToString()
    assert data.count(b"\x28\x01") == 2  # field 5 (tier) = 1 on the wire, not left at default


def test_s13_41_removal_evicts_with_the_batch_ts_unknown_hash_does_nothing(
    kit: MapperKit,
) -> None:
    run(kit, store([1], list(range(16))))
    kit.outbox.take()
    run(kit, WireRemoved([99], medium="GPU"))
    assert kit.outbox.take() == []
    run(kit, WireRemoved([1], medium="GPU"), ts=TS + 1)
    calls = kit.outbox.take()
    assert calls == [("flush",), ("evict", bytes.fromhex(fp(list(range(16)))[0]), "",
                                  TS_US + 1_000_000)]


def test_s13_42_pending_adds_are_flushed_before_a_removal(kit: MapperKit) -> None:
    run(kit, store([1, 2], list(range(32))), WireRemoved([2], medium="GPU"))
    kinds = [c[0] for c in kit.outbox.calls]
    assert kinds == ["add", "flush", "evict"]


def test_s13_43_ignore_block_removed_reports_t2_in_its_own_update() -> None:
    kit = MapperKit(ignore_block_removed=True)
    run(kit, store([1], list(range(16))))
    kit.outbox.take()
    run(kit, WireRemoved([1], medium="GPU"), store([2], list(range(100, 116))), ts=TS + 2)
    calls = kit.outbox.take()
    assert [c[0] for c in calls] == ["flush", "report", "add"]
    assert calls[1][1] == [(bytes.fromhex(fp(list(range(16)))[0]), 16, "", T2)]
    assert calls[1][2] == TS_US + 2_000_000  # the eviction's batch ts
    assert not any(c[0] == "evict" for c in calls)


def test_s13_43_non_gpu_removal_emptying_the_set_still_evicts_in_l2_mode() -> None:
    kit = MapperKit(ignore_block_removed=True)
    run(kit, store([1], list(range(16)), medium="CPU"))
    kit.outbox.take()
    run(kit, WireRemoved([1], medium="CPU"))
    assert [c[0] for c in kit.outbox.take()] == ["flush", "evict"]


@pytest.mark.parametrize("ignore", [False, True])
def test_s13_44_a_removed_block_is_forgotten(ignore: bool) -> None:
    kit = MapperKit(ignore_block_removed=ignore)
    run(kit, store([1], list(range(16))), WireRemoved([1], medium="GPU"))
    assert kit.mapper.block_count() == 0
    kit.outbox.take()
    run(kit, WireRemoved([1], medium="GPU"))
    assert kit.outbox.take() == []
    run(kit, store([2], list(range(16, 32)), parent=1))  # parent forgotten: fresh chain
    assert adds(kit)[0]["token_count"] == 16


def test_s13_45_store_remove_store_tier_history_in_l2_mode() -> None:
    kit = MapperKit(ignore_block_removed=True)
    run(kit, store([1], list(range(16))))
    run(kit, WireRemoved([1], medium="GPU"))
    run(kit, store([1], list(range(16))))
    tiers = [e[3] for c in kit.outbox.calls if c[0] in ("add", "report") for e in c[1]]
    assert tiers == [T1, T2, T1]


def test_s13_46_offload_fixture(kit: MapperKit) -> None:
    got = event_results(kit.mapper, kit.outbox,
                        decode_batch(payload("vllm-map-v0.33-offload-cpu.bin")))
    assert [[r["tier"] for r in e["report"]] for e in got] == [["T1"], ["T1"], ["T2"], []]
    assert got[3]["evict"] == [{"prefix_hash": "d6d4b41ea7e2c328", "adapter_id": ""}]
    assert got[2]["evict"] == []


def test_s13_47_cpu_store_of_a_block_not_on_gpu_is_t2(kit: MapperKit) -> None:
    run(kit, store([1], list(range(16)), medium="CPU"), store([2], list(range(16)),
                                                             medium="STORAGE"))
    assert [e[3] for e in kit.outbox.added()] == [T2, T2]


@pytest.mark.parametrize("ignore", [False, True])
def test_s13_48_clear_forgets_everything_and_sends_all_cleared(ignore: bool) -> None:
    kit = MapperKit(ignore_block_removed=ignore)
    run(kit, store([1], list(range(16))), WireAllCleared())
    assert [c[0] for c in kit.outbox.calls] == ["add", "clear"]
    assert kit.outbox.calls[1] == ("clear", TS_US)
    assert kit.mapper.block_count() == 0


def test_media_set_is_a_set_and_placeholder_only_adds_media(kit: MapperKit) -> None:
    run(kit, store([1], list(range(16))))
    block = kit.mapper.lookup((1).to_bytes(8, "big"))
    assert block is not None and block[3] == frozenset({"GPU"})
    run(kit, WireStored([1], None, [], 0, medium="cpu", group_idx=0))
    block = kit.mapper.lookup((1).to_bytes(8, "big"))
    assert block is not None and block[3] == frozenset({"GPU", "cpu"})


# ---- connector placeholders, kinds, SGLang, partial tails -----------------------------------


H = 0xD1B54A32D192ED03


def test_s13_78_connector_placeholder_map_form(caplog: pytest.LogCaptureFixture) -> None:
    kit = MapperKit()
    tokens = list(range(16))
    placeholder = WireStored([H], None, [], 0, medium="CPU", group_idx=0)
    run(kit, store([H], tokens), placeholder, WireRemoved([H], medium="GPU", group_idx=0))
    reports = [(c[0], e[3]) for c in kit.outbox.calls if c[0] in ("add", "report") for e in c[1]]
    assert reports == [("add", T1), ("report", T2)]
    assert not any(c[0] == "evict" for c in kit.outbox.calls)
    kit.outbox.take()
    run(kit, WireRemoved([H], medium="CPU", group_idx=0))
    assert [c[0] for c in kit.outbox.take()] == ["flush", "evict"]
    # The same placeholder for an unknown hash changes nothing and logs nothing.
    run(kit, placeholder)
    assert kit.outbox.take() == [] and warnings(caplog) == []
    assert kit.value("events_ignored_total", reason="no_tokens") == 2


def test_s13_78_gpu_placeholder_shape_rejects_the_batch() -> None:
    from inferencecache.kvevents import BatchRejected

    with pytest.raises(BatchRejected):
        decode_batch(encode_batch(TS, [WireStored([H], None, [], 0, medium="GPU",
                                                  group_idx=0)], "vllm-0.33"))


@pytest.mark.parametrize("fmt", ["vllm-0.20", "vllm-0.22"])
def test_s13_78_connector_placeholder_array_form(fmt: str) -> None:
    kit = MapperKit()
    run(kit, store([H], list(range(16)), group_idx=0), fmt=fmt)
    run(kit, WireStored([H], None, [], 0, medium="CPU"),  # group_idx nil → group 0
        WireRemoved([H], medium="GPU", group_idx=0), fmt=fmt)
    reports = [e[3] for c in kit.outbox.calls if c[0] in ("add", "report") for e in c[1]]
    assert reports == [T1, T2]
    assert not any(c[0] == "evict" for c in kit.outbox.calls)


@pytest.mark.parametrize(
    ("kind", "indexed"),
    [("full_attention", True), ("mla_attention", True), ("sink_full_attention", True),
     ("unknown", False), ("mamba", False), ("sliding_window", False),
     ("chunked_local_attention", False), (None, True)],
)
def test_s13_79_kv_cache_spec_kinds(kind: str | None, indexed: bool) -> None:
    kit = MapperKit()
    run(kit, store([1], list(range(16)), group_idx=3, kv_cache_spec_kind=kind))
    assert bool(kit.outbox.added()) is indexed
    assert kit.value("events_ignored_total", reason="group") == (0 if indexed else 1)


def test_s13_80_sglang_coalesced_store_and_removal(kit: MapperKit) -> None:
    tokens = list(range(1, 49))
    run(kit, store([-1, -2, -3], tokens), fmt="sglang-0.5.18")
    assert [(e["prefix_hash"], e["token_count"]) for e in adds(kit)] == [
        ("ea06fc71a5ee6e88", 16), ("ad01835a37dd294c", 32), ("0d55e56c2bccbd1a", 48)]
    kit.outbox.take()
    run(kit, WireRemoved([-1, -2, -3], medium="GPU"), fmt="sglang-0.5.18")
    evicts = [c[1].hex() for c in kit.outbox.calls if c[0] == "evict"]
    assert evicts == ["ea06fc71a5ee6e88", "ad01835a37dd294c", "0d55e56c2bccbd1a"]


def test_s13_81_bigram_store_skipped_and_warned_once(
    kit: MapperKit, caplog: pytest.LogCaptureFixture
) -> None:
    bigram = WireStored([5], None, [[1, 2]] * 16, 16, medium="GPU")
    run(kit, bigram, store([6], list(range(16))), fmt="sglang-0.5.23")
    run(kit, bigram, fmt="sglang-0.5.23")
    assert len(kit.outbox.added()) == 1  # the rest of the batch applies
    assert kit.value("events_ignored_total", reason="bigram") == 2
    assert len(warnings(caplog)) == 1


def test_s13_81_partial_tail_store_is_ignored_and_its_removal_does_nothing(
    kit: MapperKit,
) -> None:
    run(kit, store([1], list(range(16))), store([77], list(range(16, 24)), parent=1,
                                                block_size=8))
    assert len(kit.outbox.added()) == 1
    assert kit.value("events_ignored_total", reason="block_size") == 1
    kit.outbox.take()
    run(kit, WireRemoved([77], medium="GPU"))
    assert kit.outbox.take() == []


def test_chain_packed_split_matches_prefix_hashes() -> None:
    tokens = list(range(64))
    assert [int.from_bytes(b, "big") for b in split_packed(chain_packed(tokens, 16))] == (
        prefix_hashes(tokens, 16)
    )


def test_metrics_count_events_and_tracked_blocks(kit: MapperKit) -> None:
    kit.mapper.apply(decode_batch(payload("vllm-map-v0.33-unknown-event-type.bin")))
    assert kit.value("events_total", type="BlockStored") == 1
    assert kit.value("events_total", type="unknown") == 1
    assert kit.value("events_total", type="AllBlocksCleared") == 1
    assert kit.value("tracked_blocks") == 0
    run(kit, store([1, 2], list(range(32))))
    assert kit.value("tracked_blocks") == 2
    kit.mapper.apply(decode_batch(encode_batch(TS, [store([3], list(range(16)), medium=5)],
                                               "vllm-0.33")))  # type: ignore[arg-type]
    assert kit.value("fields_ignored_total", field="medium") == 1


def test_restore_mixing_known_and_new_blocks_matches_fresh_mapping() -> None:
    tokens = list(range(64))
    fresh = MapperKit()
    run(fresh, store([1, 2, 3, 4], tokens))
    mixed = MapperKit()
    run(mixed, store([2], tokens[16:32], parent=1, medium="CPU"))  # block 2 known (on CPU only)
    mixed.outbox.take()
    run(mixed, store([1, 2, 3, 4], tokens))
    a, b = adds(fresh), adds(mixed)
    assert [(e["prefix_hash"], e["token_count"]) for e in a] == [
        (e["prefix_hash"], e["token_count"]) for e in b]
    assert [e["tier"] for e in b] == ["T1"] * 4
    block = mixed.mapper.lookup((2).to_bytes(8, "big"))
    assert block is not None and block[3] == frozenset({"GPU", "CPU"})


def test_token_count_saturates_at_int32_max(kit: MapperKit) -> None:
    parent = (9).to_bytes(8, "big")
    kit.mapper._groups[0] = {parent: (bytes(8), 2**31 - 20, "", frozenset({"GPU"}))}
    run(kit, store([10, 11], list(range(32)), parent=9))
    assert [e["token_count"] for e in adds(kit)] == [2**31 - 4, 2**31 - 1]
