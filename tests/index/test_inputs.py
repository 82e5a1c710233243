"""Gates and dual input: contract-and-index.md §10 items 59-69 (step 7, G0, require_chain, chain
matching off, token_ids, prompt_text, block size)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from inferencecache import fingerprint
from inferencecache.index import IndexSettings, Reason
from inferencecache.varint import encode_all as varints
from tests.index.support import Env, FakeTokenizer, h, ids

TOKENS = list(range(1000, 1064))  # four 16-token blocks


def _ingest_tokens(env: Env, replica: str, tokens: list[int], block: int = 16) -> list[bytes]:
    hashes, counts = fingerprint.chain(tokens, block)
    env.chain(replica, hashes, counts)
    return hashes


def test_c10_59_minimum_prefix_tokens_short_circuits_without_affinity(env: Env) -> None:
    env.policy(minimum_prefix_tokens=32)
    env.policy("x", minimum_prefix_tokens=32)
    env.chain("r1", [h(1)])
    for tenant in ("t", "x"):
        res = env.lookup([h(1)], tenant_id=tenant, adapter_id="a")
        assert (res.reason_code, res.adapter_id) == (Reason.NO_HINT, "")
    assert env.lookup([h(1), h(2)]).reason_code == Reason.PREFIX_MATCH  # 32 >= 32


def test_c10_60_g0_with_affinity_on(env: Env) -> None:
    env.policy(minimum_prefix_tokens=32, affinity_routing=True)
    env.policy("x", minimum_prefix_tokens=32, affinity_routing=True)
    env.chain("r1", [h(1)])
    assert env.lookup([h(1)], tenant_id="x").reason_code == Reason.UNKNOWN_TENANT
    res = env.lookup([h(1)], adapter_id="a")
    assert res.reason_code == Reason.AFFINITY_HINT and res.adapter_id == "a"
    env.stats("r1", hit_rate=0.9)
    assert env.exact(h(7), 16).reason_code == Reason.AFFINITY_HINT  # warm-only, cut by G0
    assert env.exact(h(7), 32).reason_code == Reason.TENANT_HOT


def test_c10_61_effective_tokens_use_the_chain_sum(env: Env) -> None:
    env.chain("r1", [h(1), h(2), h(3)])
    env.policy(minimum_prefix_tokens=64)
    res = env.lookup([h(1), h(2), h(3)], prefix_hash=h(3), prefix_token_count=999)
    assert res.reason_code == Reason.NO_HINT
    env.policy(minimum_prefix_tokens=48)
    res = env.lookup([h(1), h(2), h(3)], prefix_hash=h(3), prefix_token_count=1)
    assert res.reason_code == Reason.PREFIX_MATCH


def test_c10_62_require_chain(make_env: Callable[..., Env]) -> None:
    tok = FakeTokenizer()
    env = make_env(tokenizer=tok)
    env.policy(require_chain=True, affinity_routing=True)
    hashes = _ingest_tokens(env, "r1", TOKENS)
    for kw in (
        {"prefix_hash": hashes[-1], "prefix_token_count": 64},
        {"token_ids": TOKENS},
        {"prompt_text": "x" * 64},
        {"block_hashes": hashes, "block_token_counts": [16]},
        {"block_hashes": b"", "packed_hashes": True},
    ):
        res = env.lookup(adapter_id="a", **kw)  # type: ignore[arg-type]
        assert (res.reason_code, res.adapter_id, list(res.token_ids)) == (
            Reason.POLICY_REQUIRES_CHAIN,
            "",
            [],
        )
    assert tok.calls == []
    res = env.lookup(hashes)
    assert res.reason_code == Reason.PREFIX_MATCH and ids(res) == ["r1"]


def test_c10_63_chain_matching_off(env: Env) -> None:
    env.policy(enable_chain_matching=False, affinity_routing=True)
    env.legacy("r1", h(9), 500)
    env.chain("r1", [h(1), h(2)])
    res = env.lookup([h(1), h(2)], prefix_hash=h(9), prefix_token_count=500)
    assert res.reason_code == Reason.PREFIX_MATCH
    assert res.replica_scores[0].matched_tokens == 500
    # a malformed chain is ignored when prefix_hash is set
    res = env.lookup(prefix_hash=h(9), block_hashes=[h(1)], block_token_counts=[])
    assert res.reason_code == Reason.PREFIX_MATCH
    res = env.lookup([h(1), h(2)], adapter_id="a")  # chain only
    assert (res.reason_code, res.adapter_id) == (Reason.NO_HINT, "")
    # step 7 / G0 use prefix_token_count, not the chain sum
    env.policy(enable_chain_matching=False, minimum_prefix_tokens=64)
    assert env.lookup([h(1)] * 8, prefix_hash=h(9), prefix_token_count=32).reason_code == (
        Reason.NO_HINT
    )
    assert env.lookup([h(1)], prefix_hash=h(9), prefix_token_count=64).reason_code == (
        Reason.PREFIX_MATCH
    )
    # token_ids still work, on the exact path with the last block hash (B x blocks tokens)
    hashes = _ingest_tokens(env, "r2", TOKENS)
    res = env.lookup(token_ids=TOKENS)
    assert res.reason_code == Reason.PREFIX_MATCH and ids(res) == ["r2"]
    assert res.replica_scores[0].matched_tokens == 64
    assert env.exact(hashes[-1], 64).replica_scores[0].matched_tokens == 64


def test_c10_64_token_ids_equal_the_explicit_chain(env: Env) -> None:
    hashes = _ingest_tokens(env, "r1", TOKENS[:48])
    _ingest_tokens(env, "r2", TOKENS)
    explicit = env.lookup([*hashes, fingerprint.chain(TOKENS, 16)[0][3]])
    for kw in ({"token_ids": TOKENS}, {"token_ids": varints(TOKENS), "token_varints": True}):
        res = env.lookup(**kw)  # type: ignore[arg-type]
        assert res.replica_scores == explicit.replica_scores
        assert res.reason_code == explicit.reason_code == Reason.PREFIX_MATCH
        assert list(res.token_ids) == []  # no echo of caller tokens
    # explicit block_hashes win over conflicting token_ids
    res = env.lookup([h(1)], token_ids=TOKENS)
    assert res.reason_code == Reason.NO_HINT
    # the exact key of token_ids is the last block hash, counted B x blocks
    env.policy(minimum_matched_tokens=48)
    assert ids(env.lookup(token_ids=TOKENS)) == ["r2", "r1"]


def test_c10_65_token_ids_out_of_bounds(env: Env) -> None:
    env.policy(affinity_routing=True)
    _ingest_tokens(env, "r1", TOKENS)
    env.stats("r1", hit_rate=0.9)
    for toks in (TOKENS[:15], [1] * (1_048_576 + 1)):
        for kw in ({"token_ids": toks}, {"token_ids": varints(toks), "token_varints": True}):
            res = env.lookup(adapter_id="a", **kw)  # type: ignore[arg-type]
            assert (res.reason_code, res.adapter_id, res.replica_scores) == (Reason.NO_HINT, "", [])
    # exactly at the bound is fine
    res = env.lookup(token_ids=[1] * 1_048_576)
    assert res.reason_code == Reason.AFFINITY_HINT


def test_c10_65_varints_above_32_bits_truncate_like_protobuf(env: Env) -> None:
    _ingest_tokens(env, "r1", TOKENS[:16])
    big = [t + (1 << 32) for t in TOKENS[:16]]
    res = env.lookup(token_ids=varints(big), token_varints=True)
    assert ids(res) == ["r1"]


def test_c10_66_prompt_without_tokenizer(make_env: Callable[..., Env]) -> None:
    env = make_env()
    env.policy(affinity_routing=True)
    env.chain("r1", [h(1)])
    res = env.lookup(prompt_text="x" * 64, adapter_id="a")
    assert (res.reason_code, list(res.token_ids), res.adapter_id) == (Reason.NO_HINT, [], "")
    env2 = make_env(tokenizer=FakeTokenizer(models=["other"]))
    res = env2.lookup(prompt_text="x" * 64)
    assert (res.reason_code, list(res.token_ids)) == (Reason.NO_HINT, [])


def test_c10_67_prompt_text_tokens_are_echoed(make_env: Callable[..., Env]) -> None:
    tok = FakeTokenizer()
    env = make_env(tokenizer=tok)
    text = "".join(chr(c) for c in TOKENS)
    _ingest_tokens(env, "r1", TOKENS)
    res = env.lookup(prompt_text=text)
    assert tok.calls == [("m", text)]
    assert res.reason_code == Reason.PREFIX_MATCH and list(res.token_ids) == TOKENS
    other = "".join(chr(c) for c in range(2000, 2032))
    res = env.lookup(prompt_text=other)  # novel prefix, affinity off
    assert res.reason_code == Reason.NO_HINT and list(res.token_ids) == list(range(2000, 2032))
    res = env.lookup(prompt_text=other, tenant_id="nobody")
    assert res.reason_code == Reason.UNKNOWN_TENANT and len(res.token_ids) == 32
    env.policy(affinity_routing=True)
    res = env.lookup(prompt_text=other)
    assert res.reason_code == Reason.AFFINITY_HINT and len(res.token_ids) == 32
    env.policy(minimum_prefix_tokens=1000)  # step 7
    res = env.lookup(prompt_text=other)
    assert (res.reason_code, len(res.token_ids), res.adapter_id) == (Reason.NO_HINT, 32, "")
    # TIMEOUT after tokenization (the tokenizer took longer than lookup_timeout_ms)
    env.policy(lookup_timeout_ms=100)

    def slow(text: str) -> list[int]:
        env.clock.advance(0.2)
        return [ord(c) for c in text]

    tok.fn = slow
    res = env.lookup(prompt_text=text)
    assert (res.reason_code, list(res.token_ids), res.adapter_id) == (Reason.TIMEOUT, TOKENS, "")


def test_c10_67_real_chat_tokenizer_renders_one_user_turn(make_env: Callable[..., Env]) -> None:
    """The server's ``TokenizerSet`` plugs in as the PromptTokenizer; the prompt arrives as one
    user message with the generation prompt."""
    tokenizers = pytest.importorskip("tokenizers")
    from inferencecache.tokenize import ChatTokenizer, TokenizerSet

    words = ["<u>", "<a>", *[f"w{i}" for i in range(40)]]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<u>")
    tk = tokenizers.Tokenizer(model)
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}<{{ m.role[0] }}> {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    chat = ChatTokenizer("m", tk, template)
    env = make_env(tokenizer=TokenizerSet({"m": chat}))
    text = " ".join(f"w{i}" for i in range(30))
    res = env.lookup(prompt_text=text)
    want = [0, *range(2, 32), 1]  # <u>(user role) w0..w29 <a>(generation prompt)
    assert chat.render(text).startswith("<u> ") and chat.render(text).endswith("<a>")
    assert list(res.token_ids) == want and res.reason_code == Reason.NO_HINT


def test_c10_68_prompt_bounds_and_slots(make_env: Callable[..., Env]) -> None:
    tok = FakeTokenizer()
    env = make_env(tokenizer=tok)
    env.chain("r1", [h(1)])
    res = env.lookup(prompt_text="short")
    assert (res.reason_code, list(res.token_ids)) == (Reason.NO_HINT, [ord(c) for c in "short"])
    calls = len(tok.calls)
    for text in ("a" * (1_048_576 + 1), "€" * 349_526):  # > 1 MiB of UTF-8
        res = env.lookup(prompt_text=text)
        assert (res.reason_code, list(res.token_ids)) == (Reason.NO_HINT, [])
    assert len(tok.calls) == calls
    res = env.lookup(prompt_text="€" * 349_525)  # 1,048,575 bytes: tokenized
    assert len(tok.calls) == calls + 1 and res.reason_code == Reason.NO_HINT
    # empty / oversized tokenizer output and tokenizer errors fail open without echo
    for fn in (lambda t: [], lambda t: [1] * 1_048_577, lambda t: 1 / 0):
        tok.fn = fn  # type: ignore[assignment]
        res = env.lookup(prompt_text="x" * 32)
        assert (res.reason_code, list(res.token_ids)) == (Reason.NO_HINT, [])


def test_c10_68_sixty_fifth_concurrent_tokenization_fails_open(
    make_env: Callable[..., Env],
) -> None:
    release = threading.Event()
    entered = threading.Semaphore(0)

    def blocking(text: str) -> list[int]:
        entered.release()
        release.wait(30)
        return [ord(c) for c in text]

    tok = FakeTokenizer(fn=blocking)
    env = make_env(tokenizer=tok)
    env.chain("r1", [h(1)])
    results: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(env.lookup(prompt_text="y" * 16).reason_code)
        )
        for _ in range(64)
    ]
    try:
        for t in threads:
            t.start()
        for _ in range(64):
            assert entered.acquire(timeout=30)
        res = env.lookup(prompt_text="z" * 16)
        assert (res.reason_code, list(res.token_ids)) == (Reason.NO_HINT, [])
        assert len(tok.calls) == 64
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert results == [Reason.NO_HINT] * 64  # each: novel prefix, affinity off
    # slots are back
    assert env.lookup(prompt_text="z" * 16).token_ids != ()


def test_c10_69_engine_block_size_32(make_env: Callable[..., Env]) -> None:
    env = make_env(settings=IndexSettings(engine_block_size=32))
    hashes = _ingest_tokens(env, "r1", TOKENS, block=32)
    assert len(hashes) == 2
    res = env.lookup(token_ids=TOKENS[:48])  # one full 32-block
    assert res.reason_code == Reason.PREFIX_MATCH and res.replica_scores[0].matched_tokens == 32
    assert env.lookup(token_ids=TOKENS[:31]).reason_code == Reason.NO_HINT
    assert IndexSettings(engine_block_size=0).engine_block_size == 16
    assert IndexSettings(engine_block_size=-3).engine_block_size == 16
