"""The fast (msgspec typed) and the reference event decoder agree on every input, including
what no engine sends: invalid UTF-8 in fields nobody reads, ext values, repeated map keys,
±2^64, nesting far deeper than the decoder's stack (issue 15 items 1 and 5).

The reference decodes every byte, so it is also checked against msgspec's generic decoding: a
payload msgspec cannot decode is rejected with reason ``msgpack``, and only then.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache.kvevents import BatchDecoder, BatchRejected, DecodedBatch
from inferencecache.kvevents.decode import decode_untyped
from tests.kvevents.rawpack import (
    INVALID_UTF8,
    Pairs,
    Verbatim,
    nasty,
    pack,
    str_bytes,
    worst_shapes,
)

SKIPPED_NAMES = ["extra_keys", "kv_cache_spec_sliding_window", "locality", "ownership",
                 "session_id", "lookahead_token_ids", "cache_salt", "future_field"]


def outcome(fn: Any, data: bytes) -> bytes | tuple[str, str]:
    """The decoded batch as canonical bytes (so NaN equals NaN), or the rejection reason."""
    try:
        batch: DecodedBatch = fn(data)
    except BatchRejected as e:
        return ("rejected", e.reason)
    return msgspec.msgpack.encode(batch, enc_hook=list)


def assert_agree(data: bytes) -> bytes | tuple[str, str]:
    ref = outcome(decode_untyped, data)
    for _ in range(2):  # both typed-decoder orders
        dec = BatchDecoder()
        assert outcome(dec.decode, data) == ref
        assert outcome(dec.decode, data) == ref
    try:
        msgspec.msgpack.decode(data)
        generic_ok = True
    except (msgspec.DecodeError, RecursionError):
        generic_ok = False
    if not generic_ok:
        assert ref == ("rejected", "msgpack")
    else:
        assert ref != ("rejected", "msgpack")
    return ref


@pytest.mark.parametrize("name", sorted(worst_shapes()))
def test_worst_shapes_are_rejected_or_decoded_identically(name: str) -> None:
    data = worst_shapes()[name]
    ref = assert_agree(data)
    if name.startswith("deep_") or name.startswith("huge_") or "utf8" in name:
        assert ref == ("rejected", "msgpack"), name


def test_deep_nesting_is_a_msgpack_rejection_not_a_recursion_error() -> None:
    """The issue's reproduction: ~1000 levels made RecursionError escape the decoder."""
    for depth in (1_000, 5_000, 100_000):
        payload = b"\x92\x00\x91" + b"\x91" * depth + b"\xc0"
        with pytest.raises(BatchRejected) as e:
            BatchDecoder().decode(payload)
        assert e.value.reason == "msgpack"


def test_invalid_utf8_in_skipped_content_is_rejected_by_both() -> None:
    """Was the disagreement: the typed decoder skipped unknown keys and Raw fields unread."""
    base = [("type", "BlockStored"), ("block_hashes", [1]), ("token_ids", [1, 2]),
            ("block_size", 2)]
    assert isinstance(outcome(decode_untyped, pack([0.0, [Pairs(base)]])), bytes)
    for bad in INVALID_UTF8:
        s = Verbatim(str_bytes(bad))
        for extra in ([("session_id", s)], [("extra_keys", [s])], [(s, 1)], [("x", [s])]):
            data = pack([0.0, [Pairs(base + extra)]])
            assert assert_agree(data) == ("rejected", "msgpack")
        arr = ["BlockStored", [1], None, [1, 2], 2, None, None, None, [s], None, None, None]
        assert assert_agree(pack([0.0, [arr]])) == ("rejected", "msgpack")
        assert assert_agree(pack([0.0, [[*arr[:12], s]]])) == ("rejected", "msgpack")
        assert assert_agree(pack([0.0, [], s])) == ("rejected", "msgpack")


def test_repeated_raw_keys_and_an_earlier_rejection_defer_to_the_reference() -> None:
    """Found by the engine_frames fuzz harness: msgspec keeps the last of repeated keys without
    looking inside the earlier values, and a rule broken by an earlier event used to decide
    before a later event's raw field was read. The reference decodes every byte first."""
    bad = Verbatim(str_bytes(b"\xff"))
    base = [("type", "BlockStored"), ("block_hashes", [1]), ("block_size", 2)]
    for name in ("token_ids", "block_hashes", "extra_keys", "session_id"):
        first = [bad] if name in ("token_ids", "block_hashes", "extra_keys") else bad
        ev = Pairs([*base, ("token_ids", [1, 2]), (name, first), (name, [1, 2])])
        assert assert_agree(pack([0.0, [ev]])) == ("rejected", "msgpack"), name
    zero = Pairs([*base, ("token_ids", [1, 2]), ("block_size", 0)])  # breaks the block-size rule
    later = Pairs([("type", "BlockRemoved"), ("block_hashes", [bad])])
    assert assert_agree(pack([0.0, [zero, later]])) == ("rejected", "msgpack")
    assert assert_agree(pack([0.0, [zero]])) == ("rejected", "block_size")
    # a field name inside the data is only a detour through the reference, never a rejection
    named = Pairs([*base, ("token_ids", [1, 2]), ("lora_name", "token_ids")])
    assert isinstance(assert_agree(pack([0.0, [named]])), bytes)


# ---- property: agreement on generated hostile batches ----------------------------------------

leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=4), st.binary(max_size=9), nasty(),
)
junk = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=3)
    | st.lists(st.tuples(st.one_of(st.text(max_size=3), inner), inner), max_size=3).map(Pairs),
    max_leaves=6,
)
ints = st.integers(-(2**63), 2**64 - 1)
hashes = st.one_of(ints, st.binary(min_size=1, max_size=9), st.text(max_size=3), nasty())


@st.composite
def stored(draw: st.DrawFn) -> Any:
    bs = draw(st.sampled_from([1, 2, 4, 0]))
    fields = [
        ("block_hashes", draw(st.one_of(st.lists(hashes, max_size=3), junk))),
        ("parent_block_hash", draw(st.one_of(st.none(), hashes))),
        ("token_ids", draw(st.one_of(st.lists(st.integers(0, 2**32 - 1), max_size=3 * bs + 1),
                                     st.lists(st.lists(st.integers(0, 9), min_size=2,
                                                       max_size=2), max_size=2),
                                     junk))),
        ("block_size", draw(st.one_of(st.just(bs), junk))),
        ("lora_id", draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), junk))),
        ("medium", draw(st.one_of(st.sampled_from([None, "GPU", "CPU"]), junk))),
        ("lora_name", draw(st.one_of(st.none(), st.text(max_size=4), junk))),
        ("extra_keys", draw(junk)),
        ("group_idx", draw(st.one_of(st.none(), st.integers(-2, 2), junk))),
        ("kv_cache_spec_kind", draw(st.one_of(st.none(), st.just("full_attention"), junk))),
        ("kv_cache_spec_sliding_window", draw(junk)),
    ]
    if draw(st.booleans()):
        keep = [kv for kv in fields if draw(st.integers(0, 4))]
        extra = draw(st.lists(st.tuples(st.one_of(st.sampled_from(SKIPPED_NAMES), junk), junk),
                              max_size=2))
        repeated = draw(st.lists(st.tuples(st.sampled_from(["token_ids", "block_hashes",
                                                             "extra_keys", "session_id"]),
                                           junk), max_size=1))
        items = [("type", "BlockStored"), *repeated, *keep, *extra]
        if draw(st.booleans()):
            items = draw(st.permutations(items))
        return Pairs(items)
    n = draw(st.integers(4, 13))
    values = [v for _, v in fields] + draw(st.lists(junk, max_size=2))
    return ["BlockStored", *values[: n - 1]]


@st.composite
def removed(draw: st.DrawFn) -> Any:
    hs = draw(st.one_of(st.lists(hashes, max_size=3), junk))
    if draw(st.booleans()):
        extra = draw(st.lists(st.tuples(st.sampled_from(["locality", "ownership", "medium",
                                                         "group_idx", "x"]), junk), max_size=2))
        return Pairs([("type", "BlockRemoved"), ("block_hashes", hs), *extra])
    return ["BlockRemoved", hs, *draw(st.lists(junk, max_size=3))]


events = st.one_of(
    stored(), removed(),
    st.sampled_from([["AllBlocksCleared"], Pairs([("type", "AllBlocksCleared")])]),
    st.builds(lambda v: ["AllBlocksCleared", v], junk),
    st.builds(lambda v: Pairs([("type", "AllBlocksCleared"), ("x", v)]), junk),
    junk,
)
batches = st.one_of(
    st.builds(lambda ts, evs, tail: [ts, evs, *tail],
              st.one_of(st.floats(allow_nan=False), st.integers(0, 2**40), junk),
              st.lists(events, max_size=4), st.lists(junk, max_size=2)),
    st.builds(lambda ts, evs: Pairs([("ts", ts), ("events", evs)]), st.floats(),
              st.lists(events, max_size=3)),
    junk,
)


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_fast_and_reference_agree_on_hostile_batches(obj: Any) -> None:
    assert_agree(pack(obj))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.integers(0, 2**16), st.integers(0, 255))
def test_fast_and_reference_agree_on_one_flipped_byte(obj: Any, pos: int, byte: int) -> None:
    data = bytearray(pack(obj))
    if data:
        data[pos % len(data)] = byte
    assert_agree(bytes(data))
