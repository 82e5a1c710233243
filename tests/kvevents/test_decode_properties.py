"""Property tests: the decoder only ever rejects with BatchRejected, and the fast path is an
exact twin of the reference decoder (results and rejection reasons)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferencecache.kvevents import BatchDecoder, BatchRejected, DecodedBatch
from inferencecache.kvevents.decode import decode_untyped

enc = msgspec.msgpack.Encoder()

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=4)
    | st.binary(max_size=9),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=3),
    max_leaves=6,
)
ints = st.integers(-(2**63), 2**64 - 1)
hashes = st.one_of(ints, st.binary(min_size=1, max_size=33), st.text(max_size=4))
maybe = lambda s: st.one_of(s, junk)  # noqa: E731


def token_lists(bs: int) -> st.SearchStrategy[Any]:
    assert bs <= 16  # keep generated lists small
    return st.one_of(
        st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=3 * bs),
        st.just(list(range(bs))),
        st.lists(st.lists(st.integers(0, 9), min_size=2, max_size=2), max_size=3),
        junk,
    )


@st.composite
def stored(draw: st.DrawFn) -> Any:
    bs = draw(st.sampled_from([1, 4, 16, 0, -1, 2**31]))
    fields = {
        "block_hashes": draw(st.one_of(st.lists(hashes, max_size=3), junk)),
        "parent_block_hash": draw(st.one_of(st.none(), hashes, junk)),
        "token_ids": draw(token_lists(min(max(bs, 1), 16))),
        "block_size": draw(st.one_of(st.just(bs), junk)),
        "lora_id": draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), junk)),
        "medium": draw(st.one_of(st.sampled_from([None, "GPU", "gpu", "CPU", "STORAGE"]), junk)),
        "lora_name": draw(st.one_of(st.none(), st.text(max_size=4), junk)),
        "extra_keys": draw(junk),
        "group_idx": draw(st.one_of(st.none(), st.integers(-3, 3), junk)),
        "kv_cache_spec_kind": draw(st.one_of(st.none(), st.sampled_from(
            ["full_attention", "sliding_window"]), junk)),
    }
    if draw(st.booleans()):
        names = list(fields)
        drop = draw(st.sets(st.sampled_from(names), max_size=3))
        return {"type": "BlockStored", **{k: v for k, v in fields.items() if k not in drop}}
    n = draw(st.integers(3, 12))
    return ["BlockStored", *list(fields.values())[: n - 1]]


@st.composite
def removed(draw: st.DrawFn) -> Any:
    hs = draw(st.one_of(st.lists(hashes, max_size=3), junk))
    medium = draw(st.one_of(st.none(), st.just("GPU"), st.just("CPU"), junk))
    if draw(st.booleans()):
        return {"type": "BlockRemoved", "block_hashes": hs, "medium": medium}
    return ["BlockRemoved", hs, medium][: draw(st.integers(1, 3))]


events = st.one_of(
    stored(),
    removed(),
    st.sampled_from([["AllBlocksCleared"], {"type": "AllBlocksCleared"},
                     {"type": "BlockPinned", "x": 1}, ["Future", 1]]),
    junk,
)
batches = st.one_of(
    st.tuples(st.one_of(st.floats(allow_nan=False), st.integers(0, 2**40), junk),
              st.lists(events, max_size=4), st.integers(0, 3)).map(list),
    st.builds(lambda ts, evs: {"ts": ts, "events": evs}, st.floats(allow_nan=False),
              st.lists(events, max_size=3)),
    junk,
)


def outcome(fn: Any, data: bytes) -> DecodedBatch | tuple[str, str]:
    try:
        return fn(data)  # type: ignore[no-any-return]
    except BatchRejected as e:
        return ("rejected", e.reason)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64))
def test_random_bytes_only_ever_raise_batch_rejected(data: bytes) -> None:
    fast = BatchDecoder()
    assert outcome(fast.decode, data) == outcome(decode_untyped, data)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_fast_path_is_an_exact_twin_of_the_reference(obj: Any) -> None:
    data = enc.encode(obj)
    ref = outcome(decode_untyped, data)
    for _ in range(2):  # both typed-decoder orders
        assert outcome(BatchDecoder().decode, data) == ref


@settings(max_examples=200)
@given(batches, st.integers(1, 40))
def test_truncated_payloads_are_rejected_never_crash(obj: Any, cut: int) -> None:
    data = enc.encode(obj)
    short = data[: max(0, len(data) - cut)]
    assert outcome(BatchDecoder().decode, short) == outcome(decode_untyped, short)
