"""int32 wrap (contract-and-index.md §10 item 90) and this project's ingest/lookup bounds (§4.2)."""

from __future__ import annotations

from collections.abc import Callable

from inferencecache.index import IndexSettings, Prefix, Reason
from inferencecache.index.settings import (
    MAX_BLOCKS_PER_ENTRY,
    MAX_ENTRIES_PER_UPDATE,
    MAX_HASH_BYTES,
)
from tests.index.support import Env, h, ids

I32_MAX = 2**31 - 1
I32_MIN = -(2**31)


def test_c10_90_wrapped_run_sum_is_dropped(env: Env) -> None:
    env.chain("r1", [h(1), h(2)])
    res = env.lookup([h(1), h(2)], [I32_MAX, I32_MAX])
    assert res.reason_code == Reason.NO_HINT and res.replica_scores == []
    # a single block at the maximum is a normal match
    res = env.lookup([h(1)], [I32_MAX])
    assert res.replica_scores[0].matched_tokens == I32_MAX


def test_c10_90_ingest_and_effective_tokens_wrap(env: Env) -> None:
    env.chain("r1", [h(1), h(2)], [I32_MAX, 1])
    held = env.holds()
    assert held[("t", "m", "vllm", "", h(2), "r1")][0] == I32_MIN
    assert env.exact(h(2)).replica_scores[0].matched_tokens == I32_MIN  # exact path: as stored
    env.legacy("r1", h(3), 2**32 + 5)  # only reachable from Python callers; wraps like int32
    assert env.exact(h(3)).replica_scores[0].matched_tokens == 5
    env.policy(minimum_prefix_tokens=10)
    assert env.lookup([h(1), h(2)], [I32_MAX, I32_MAX]).reason_code == Reason.NO_HINT
    env.check()


def test_bound_blocks_per_entry(make_env: Callable[..., Env]) -> None:
    env = make_env()
    n = MAX_BLOCKS_PER_ENTRY
    env.chain("r1", [h(i) for i in range(n + 1)], 1)
    assert env.index.counts()["keys"] == 0
    assert env.metrics.dropped == {"chain_too_long": 1}
    env.chain("r1", [h(i) for i in range(n)], 1)
    assert env.index.counts()["keys"] == n
    res = env.lookup([h(i) for i in range(n + 1)], 1)
    assert (res.reason_code, res.adapter_id) == (Reason.NO_HINT, "")  # over-bound lookup
    res = env.lookup([h(i) for i in range(n)], 1)
    assert res.replica_scores[0].matched_tokens == n


def test_bound_entries_per_update(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=IndexSettings(max_entries_per_update=3))
    env.update("r1", [Prefix(prefix_hash=h(i), token_count=16) for i in range(5)])
    assert {k[4] for k in env.holds()} == {h(0), h(1), h(2)}
    assert env.metrics.dropped == {"too_many_entries": 2}
    assert IndexSettings().max_entries_per_update == MAX_ENTRIES_PER_UPDATE == 65_536


def test_bound_hash_bytes(env: Env) -> None:
    big = b"x" * (MAX_HASH_BYTES + 1)
    ok = b"y" * MAX_HASH_BYTES
    env.update(
        "r1",
        [
            Prefix(prefix_hash=big, token_count=16),
            Prefix(block_hashes=[h(1), big], block_token_counts=[16, 16]),
            Prefix(block_hashes=[h(2)], block_token_counts=[16], prefix_hash=big),
            Prefix(prefix_hash=ok, token_count=16),
            Prefix(prefix_hash=b"", token_count=16),  # empty hashes are stored as given
        ],
    )
    assert {k[4] for k in env.holds()} == {ok, b""}
    assert env.metrics.dropped == {"hash_too_long": 3}


def test_malformed_entries_never_corrupt_other_state(env: Env) -> None:
    env.chain("r0", [h(100)])
    env.update(
        "r1",
        [
            Prefix(block_hashes=[h(1), h(2)], block_token_counts=[16]),
            Prefix(prefix_hash=h(3), token_count=-7, tier=-9),
            Prefix(block_hashes=[h(4)], block_token_counts=[16], tier=2**40),
            Prefix(block_token_counts=[1]),
            Prefix(prefix_hash=h(5), token_count=64, adapter_id="z"),
        ],
        stats=None,
    )
    assert {(k[3], k[4], v[0], v[2]) for k, v in env.holds().items() if k[5] == "r1"} == {
        ("", h(3), -7, I32_MAX),
        ("", h(4), 16, I32_MAX),
        ("z", h(5), 64, 1),
    }
    assert ids(env.lookup([h(100)])) == ["r0"]
    assert env.metrics.dropped == {"chain_length_mismatch": 2}
    env.check()
