"""LoRA id→name table and resolution order (engine-events-and-subscriber.md §5, §13 items 36-37)."""

from __future__ import annotations

import pytest

from inferencecache.subscriber.lora import LoraResolver, parse_adapter_names


def test_s13_36_whitespace_and_empty_items() -> None:
    assert parse_adapter_names(" 1=sql-lora, 2 = chat-lora ,") == {1: "sql-lora", 2: "chat-lora"}
    assert parse_adapter_names("") == {}
    assert parse_adapter_names(" , ,") == {}


def test_s13_83_item_splits_at_its_first_equals_sign() -> None:
    assert parse_adapter_names("1=a=b") == {1: "a=b"}
    assert parse_adapter_names("+3=x,-4=y") == {3: "x", -4: "y"}


@pytest.mark.parametrize(
    "text",
    ["sql-lora", "x=sql-lora", "1=", "1=a,1=b", "1_0=a", "١=a", " =a", "1.0=a",
     f"{2**63}=a"],
)
def test_s13_37_bad_tables_raise(text: str) -> None:
    with pytest.raises(ValueError):
        parse_adapter_names(text)


def test_resolution_order() -> None:
    r = LoraResolver({1: "mapped"}, trust_lora_name=True)
    assert r.resolve(None, None) == ""
    assert r.resolve(None, "") == ""
    assert r.resolve(1, "engine-name") == "mapped"  # an explicit map entry wins
    assert r.resolve(7, "named") == "named"
    assert r.resolve(None, "named") == "named"
    assert r.resolve(7, None) is None
    assert r.resolve(7, "") is None
    strict = LoraResolver({1: "mapped"}, trust_lora_name=False)
    assert strict.resolve(1, "x") == "mapped"
    assert strict.resolve(7, "named") is None
    assert strict.resolve(None, "named") is None
    assert strict.resolve(None, None) == ""
