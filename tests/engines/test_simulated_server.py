"""``fake-engine --mode simulated`` as a process: OpenAI routes over real HTTP on loopback,
KV events on a real ZeroMQ SUB socket in the real wire format, vLLM metric names, queueing,
reset, the oracle endpoint."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from inferencecache import fingerprint
from inferencecache.kvevents import decode_batch
from inferencecache.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from inferencecache.kvevents.framing import parse_live
from inferencecache.procs import Child
from tests.subscriber.conftest import MapperKit

B = 4
MODEL = "sim-m"


def start(*extra: str) -> tuple[Child, str, str]:
    proc = Child(
        "fake-engine", "--mode", "simulated", "--bind", "tcp://127.0.0.1:0",
        "--http-address", "127.0.0.1:0", "--model-name", MODEL, "--block-size", str(B),
        "--lora-adapters", "1=sql-lora", *extra,
    )
    try:
        rec = proc.wait_log("simulated engine ready", timeout=20)
    except BaseException:
        proc.stop()
        raise
    return proc, str(rec["endpoint"]), str(rec["http_address"])


@pytest.fixture
def engine() -> Iterator[tuple[Child, str, str]]:
    proc, endpoint, http = start("--gpu-blocks", "8", "--prefill-ms-per-token", "0.01",
                                 "--decode-ms-per-token", "0.1")
    try:
        yield proc, endpoint, http
    finally:
        proc.stop()


def post(http: str, path: str, body: Any, timeout: float = 10.0) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"http://{http}{path}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    text = raw.decode()
    if text.startswith("data: "):
        return status, text
    return status, json.loads(text) if text else None


def get(http: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{http}{path}", timeout=10) as r:
        return str(r.read().decode())


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in the metrics page"
    return float(m.group(1))


def subscriber(endpoint: str) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return ctx, sub


def batches(sub: zmq.Socket[bytes], timeout: float = 5.0) -> list[Any]:
    """Every batch that arrives within ``timeout`` after the first (bounded)."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sub.poll(200):
            if out:
                break
            continue
        _, _, payload = parse_live(sub.recv_multipart())
        out.append(decode_batch(payload))
    return out


def completion(http: str, tokens: list[int], model: str = MODEL, **kw: Any) -> tuple[int, Any]:
    return post(http, "/v1/completions", {"model": model, "prompt": tokens, **kw})


def joined(http: str, endpoint: str) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    """A SUB socket that provably receives (PUB drops until the SUB has joined): send probe
    requests until one batch arrives."""
    ctx, sub = subscriber(endpoint)
    for i in range(50):
        completion(http, [60_000 + i] * B, max_tokens=1)
        if sub.poll(200):
            batches(sub, timeout=1.0)
            return ctx, sub
    sub.close()
    ctx.term()
    raise AssertionError("no KV event batch reached the SUB socket")


def test_completions_hit_the_prefix_cache_and_publish_real_events(
    engine: tuple[Child, str, str],
) -> None:
    _, endpoint, http = engine
    ctx, sub = joined(http, endpoint)
    try:
        prompt = list(range(1000, 1000 + 3 * B + 1))  # 3 full blocks and a partial one
        status, body = completion(http, prompt, max_tokens=3)
        assert status == 200
        assert body["object"] == "text_completion" and body["model"] == MODEL
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["usage"]["completion_tokens"] == 3
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        got = batches(sub)
        stored = [e for b in got for e in b.events if isinstance(e, BlockStored)]
        assert len(stored) == 1
        ev = stored[0]
        assert ev.block_size == B and len(ev.block_hashes) == 3 and ev.parent_block_hash is None
        assert ev.token_ids == prompt[: 3 * B] and ev.medium == "GPU"
        # the real subscriber mapping turns them into exactly the gateway's fingerprints
        kit = MapperKit(block_size=B)
        for b in got:
            kit.mapper.apply(b)
        added = [e for e in kit.outbox.added() if e[0] in set(fingerprint.chain(prompt, B)[0])]
        assert [(e[0], e[1]) for e in added] == list(
            zip(fingerprint.chain(prompt, B)[0], (B, 2 * B, 3 * B), strict=True))
        queries = metric(get(http, "/metrics"), "vllm:prefix_cache_queries_total")
        # same prompt again: every full block but the last token's is a hit (vLLM's rule)
        status, body = completion(http, prompt, max_tokens=1)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * B
        assert not [e for b in batches(sub, 1.0) for e in b.events if isinstance(e, BlockStored)]
        # the oracle view agrees, and adapters are separate partitions
        assert post(http, "/debug/cache/match", {"model": MODEL, "tokens": prompt}) == (
            200, {"matched_tokens": 3 * B})
        assert post(http, "/debug/cache/match", {"model": "sql-lora", "tokens": prompt}) == (
            200, {"matched_tokens": 0})
        page = get(http, "/metrics")
        assert metric(page, "vllm:prefix_cache_hits_total") == 3 * B
        assert metric(page, "vllm:prefix_cache_queries_total") == queries + len(prompt)
    finally:
        sub.close()
        ctx.term()


def test_lora_requests_carry_the_adapter_and_eviction_publishes_removals(
    engine: tuple[Child, str, str],
) -> None:
    _, endpoint, http = engine
    ctx, sub = joined(http, endpoint)
    try:
        status, _ = completion(http, list(range(2000, 2000 + 2 * B)), model="sql-lora")
        assert status == 200
        ev = next(e for b in batches(sub) for e in b.events if isinstance(e, BlockStored))
        assert ev.lora_name == "sql-lora" and ev.lora_id == 1
        # 8 blocks of capacity: a 6-block prompt must evict older blocks, one hash per event
        status, _ = completion(http, list(range(3000, 3000 + 6 * B)))
        assert status == 200
        evs = [e for b in batches(sub) for e in b.events]
        removed = [e for e in evs if isinstance(e, BlockRemoved)]
        assert removed and all(len(e.block_hashes) == 1 for e in removed)
        assert any(isinstance(e, BlockStored) and len(e.block_hashes) == 6 for e in evs)
        assert metric(get(http, "/metrics"), "vllm:kv_cache_usage_perc") == 1.0
        # reset: AllBlocksCleared, and nothing is cached any more
        status, _ = post(http, "/reset_prefix_cache", {})
        assert status == 200
        evs = [e for b in batches(sub) for e in b.events]
        assert any(isinstance(e, AllBlocksCleared) for e in evs)
        assert post(http, "/debug/cache/match",
                    {"model": MODEL, "tokens": list(range(3000, 3000 + 6 * B))})[1] == {
            "matched_tokens": 0}
        assert metric(get(http, "/metrics"), "vllm:kv_cache_usage_perc") == 0.0
    finally:
        sub.close()
        ctx.term()


def test_models_errors_and_streaming(engine: tuple[Child, str, str]) -> None:
    _, _, http = engine
    models = json.loads(get(http, "/v1/models"))
    assert [(m["id"], m["parent"]) for m in models["data"]] == [(MODEL, None),
                                                                 ("sql-lora", MODEL)]
    assert completion(http, [1, 2, 3], model="nope")[0] == 404
    assert completion(http, "text without a tokenizer")[0] == 400  # type: ignore[arg-type]
    assert completion(http, [1, 2, 3], max_tokens=0)[0] == 400
    assert completion(http, list(range(100)))[0] == 400  # 25 blocks > the 8-block cache
    assert post(http, "/debug/cache/match", {"model": MODEL, "tokens": ["x"]})[0] == 400
    status, text = completion(http, list(range(10, 10 + 2 * B)), max_tokens=3, stream=True,
                              stream_options={"include_usage": True})
    assert status == 200
    chunks = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    bodies = [json.loads(c) for c in chunks[:-1]]
    assert bodies[0]["choices"][0]["finish_reason"] is None
    assert bodies[1]["choices"][0]["finish_reason"] == "length"
    assert bodies[-1]["usage"]["completion_tokens"] == 3
    status, body = post(http, "/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "tokenizer" in body["error"]["message"]


def test_a_full_engine_queues_requests() -> None:
    """One sequence slot and slow decoding: a second request waits (vLLM's waiting gauge)."""
    proc, _, http = start("--max-num-seqs", "1", "--decode-ms-per-token", "400")
    try:
        results: list[int] = []

        def call(seed: int) -> None:
            results.append(completion(http, [seed] * 8, max_tokens=4, timeout=30)[0])

        threads = [threading.Thread(target=call, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        seen = (0.0, 0.0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            page = get(http, "/metrics")
            seen = (metric(page, "vllm:num_requests_running"),
                    metric(page, "vllm:num_requests_waiting"))
            if seen == (1.0, 1.0):
                break
            time.sleep(0.02)
        for t in threads:
            t.join(30)
        assert seen == (1.0, 1.0)
        assert results == [200, 200]
        page = get(http, "/metrics")
        assert (metric(page, "vllm:num_requests_running"),
                metric(page, "vllm:num_requests_waiting")) == (0.0, 0.0)
    finally:
        proc.stop()


@pytest.mark.parametrize(
    ("args", "flag"),
    [(["--max-num-seqs", "0"], "--max-num-seqs"),
     (["--prefill-ms-per-token", "-1"], "--prefill-ms-per-token"),
     (["--http-address", ""], "--http-address")],
)
def test_bad_simulated_flags_exit_2(args: list[str], flag: str) -> None:
    from inferencecache.procs import run_cli

    r = run_cli(["fake-engine", "--mode", "simulated", "--bind", "tcp://127.0.0.1:0", *args])
    assert r.returncode == 2 and flag in r.stderr


def test_text_prompts_are_tokenized_exactly_like_the_gateway(tmp_path: Any) -> None:
    """With --tokenizer-dir, text completions and chats become the ids ``tokenize.openai``
    computes for the gateway, so their blocks match the gateway's fingerprint."""
    from inferencecache.tokenize.openai import (
        chat_prompt_ids,
        completion_prompt_ids,
        load_engine_tokenizers,
    )
    from tests.tokenize.tinytok import write_model

    write_model(tmp_path, MODEL, with_bos_post_processor=True)
    tok = load_engine_tokenizers(tmp_path)[MODEL]
    proc, _, http = start("--tokenizer-dir", str(tmp_path))
    try:
        text = "hello world the quick brown fox jumps over the lazy dog " * 3
        body = {"model": MODEL, "prompt": text, "max_tokens": 2}
        status, answer = post(http, "/v1/completions", body)
        assert status == 200
        ids = completion_prompt_ids(tok, body)
        assert answer["usage"]["prompt_tokens"] == len(ids)
        full = len(ids) // B * B
        assert post(http, "/debug/cache/match", {"model": MODEL, "tokens": ids})[1] == {
            "matched_tokens": full}
        chat = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": text}]}
        status, answer = post(http, "/v1/chat/completions", chat)
        assert status == 200 and answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["role"] == "assistant"
        ids = chat_prompt_ids(tok, chat)
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert post(http, "/debug/cache/match", {"model": MODEL, "tokens": ids})[1] == {
            "matched_tokens": len(ids) // B * B}
    finally:
        proc.stop()


KV_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_role_handoff_params_and_misrouted_handoffs(role: str) -> None:
    """``--kv-role``: a prefill for a remote decode answers with the NIXL-style params the
    decode side needs; a decode with remote prefill params counts its peer; each role refuses
    the other side's handoff (400), and serves plain requests locally."""
    proc, _endpoint, http = start("--kv-role", role, "--prefill-ms-per-token", "0.01")
    try:
        prompt = list(range(100, 100 + 3 * B))
        assert completion(http, prompt, max_tokens=2)[0] == 200  # plain: served locally
        status, body = completion(http, prompt, max_tokens=1, stream=False,
                                  kv_transfer_params=KV_PREFILL)  # fmt: skip
        pulled = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_engine_id": "peer-1", "remote_block_ids": [0, 1, 2],
                  "remote_host": "127.0.0.1", "remote_port": 1}  # fmt: skip
        status2, body2 = completion(http, prompt, max_tokens=2, kv_transfer_params=pulled)
        page = get(http, "/metrics")
        if role == "prefill":
            assert status == 200
            kv = body["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
            assert kv["remote_block_ids"] == [0, 1, 2]
            assert (kv["remote_host"], str(kv["remote_port"])) == tuple(http.rsplit(":", 1))
            assert isinstance(kv["remote_engine_id"], str) and kv["remote_engine_id"]
            assert status2 == 400 and "only prefills" in json.dumps(body2)
            assert 'inferencecache_engine_kv_transfers_total{peer="",side="producer"} 1.0' in page
        else:
            assert status == 400 and "only decodes" in json.dumps(body)
            assert status2 == 200 and "kv_transfer_params" not in body2
            assert ('inferencecache_engine_kv_transfers_total{peer="peer-1",side="consumer"} 1.0'
                    in page)  # fmt: skip
        bad = completion(http, prompt, max_tokens=1, kv_transfer_params=[1])
        assert bad[0] == 400
    finally:
        proc.stop()
