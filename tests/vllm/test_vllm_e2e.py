"""Issue 5: real vLLM CPU engines -> ZeroMQ KV events -> subscribers -> server -> LookupRoute.

Every prompt is unique to its test (its first block differs), so tests do not see each other's
blocks; each one asserts the index against what the engine really did. Engine B is restarted by
the last test. The cluster (``cluster.py``) is shared by the whole session: starting an engine
costs 25-90 s on the 2-core CI machine.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from inferencecache.tokenize.openai import chat_prompt_ids
from tests.vllm.cluster import ADAPTER_POLL_S, Cluster, full_blocks
from tests.vllm.engine import BLOCK, MODEL_NAME, http_json

# func_only: the session fixture's set-up (setup-vllm, two engine starts) has its own bounds.
pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(300, func_only=True)]


def test_prompt_served_by_each_engine_is_a_prefix_match_on_that_engine(cluster: Cluster) -> None:
    """Issue 5 item 1: matched_tokens = the prompt's full 32-token blocks, on the engine only."""
    text_a = cluster.prompt("item1 A", blocks=6)
    text_b = cluster.prompt("item1 B", blocks=5)
    ids_a = cluster.serve("A", text_a)
    ids_b = cluster.serve("B", text_b)
    cluster.wait_held(ids_a, {"A": full_blocks(len(ids_a))})
    cluster.wait_held(ids_b, {"B": full_blocks(len(ids_b))})
    resp = cluster.lookup(ids_a)
    assert resp.reason_code == "PREFIX_MATCH"
    assert [(s.replica_id, s.matched_tokens) for s in resp.replica_scores] == [
        ("A", 6 * BLOCK)]
    assert resp.replica_scores[0].score > 0
    # The same prompt with one more word shares the full blocks and nothing beyond them.
    longer = cluster.ids(text_a + " tail")
    assert cluster.held(longer) == {"A": full_blocks(len(ids_a))}
    # The engine agrees: a repeat of the prompt hits exactly those blocks.
    usage = cluster.engines["A"].complete(text_a)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == full_blocks(len(ids_a))


def test_eviction_on_the_small_engine_removes_its_hints(cluster: Cluster) -> None:
    """Issue 5 item 2: engine B (48 blocks) evicts an old prompt; its hints go, the newest stay."""
    old_text = cluster.prompt("item2 old", blocks=8)
    old = cluster.serve("B", old_text)
    cluster.wait_held(old, {"B": full_blocks(len(old))})
    evictions_before = cluster.sub_metric("B", "evictions_total")
    newest: list[int] = []
    for i in range(4):  # 4 x 25 blocks through a cache of SMALL_CACHE_BLOCKS = 48
        newest = cluster.serve("B", cluster.prompt(f"item2 filler {i}", blocks=25))
    cluster.wait_held(old, {})
    cluster.wait_held(newest, {"B": full_blocks(len(newest))})
    assert cluster.sub_metric("B", "evictions_total") > evictions_before
    # The engine agrees: the old prompt is no longer cached.
    usage = cluster.engines["B"].complete(old_text)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_reset_prefix_cache_clears_the_engines_hints(cluster: Cluster) -> None:
    """Issue 5 item 3: POST /reset_prefix_cache on A -> AllBlocksCleared -> A's hints go.

    vLLM publishes the clear with its next engine step, so a one-token request follows."""
    on_a = [cluster.serve("A", cluster.prompt(f"item3 A{i}", blocks=4)) for i in range(2)]
    on_a.append(cluster.serve("A", cluster.prompt("item3 sql", blocks=4), model="sql-lora"))
    on_b = cluster.serve("B", cluster.prompt("item3 B", blocks=4))
    for ids in on_a[:2]:
        cluster.wait_held(ids, {"A": full_blocks(len(ids))})
    cluster.wait_held(on_a[2], {"A": full_blocks(len(on_a[2]))}, adapter="sql-lora")
    cluster.wait_held(on_b, {"B": full_blocks(len(on_b))})
    cleared_before = cluster.sub_metric("A", "all_cleared_total")

    status, _, body = http_json(cluster.engines["A"].url + "/reset_prefix_cache", method="POST")
    assert status == 200, body
    cluster.engines["A"].complete("hi", max_tokens=1)  # shorter than a block: stores nothing

    for ids in on_a[:2]:
        cluster.wait_held(ids, {})
    cluster.wait_held(on_a[2], {}, adapter="sql-lora")
    got = cluster.wait_sub_metric("A", "all_cleared_total", cleared_before + 1)
    assert got == cleared_before + 1
    assert cluster.held(on_b) == {"B": full_blocks(len(on_b))}  # the other engine is untouched


def test_lora_adapter_and_base_model_are_separate_partitions(cluster: Cluster) -> None:
    """Issue 5 item 5: the adapter's blocks carry its name; base and adapter never cross-match."""
    only_adapter = cluster.prompt("item5 adapter", blocks=4)
    only_base = cluster.prompt("item5 base", blocks=4)
    ids_adapter = cluster.serve("A", only_adapter, model="sql-lora")
    ids_base = cluster.serve("A", only_base)
    full_adapter, full_base = full_blocks(len(ids_adapter)), full_blocks(len(ids_base))
    cluster.wait_held(ids_adapter, {"A": full_adapter}, adapter="sql-lora")
    cluster.wait_held(ids_base, {"A": full_base})
    assert cluster.held(ids_adapter) == {}  # base-model lookup of the adapter's prompt
    assert cluster.held(ids_base, adapter="sql-lora") == {}  # and the other way round

    # The identical prompt sent to the base model now lands in the base partition as well.
    cluster.serve("A", only_adapter)
    cluster.wait_held(ids_adapter, {"A": full_adapter})
    assert cluster.held(ids_adapter, adapter="sql-lora") == {"A": full_adapter}

    # An adapter loaded at runtime gets its own partition under its name.
    chat_dir = cluster.assets.adapter("chat-lora")
    status, _, body = http_json(cluster.engines["A"].url + "/v1/load_lora_adapter",
                                {"lora_name": "chat-lora", "lora_path": str(chat_dir)})
    assert status == 200, body
    try:
        ids_chat = cluster.serve("A", only_base, model="chat-lora")
        cluster.wait_held(ids_chat, {"A": full_base}, adapter="chat-lora")
        assert cluster.held(cluster.ids(only_adapter), adapter="chat-lora") == {}
    finally:
        status, _, body = http_json(cluster.engines["A"].url + "/v1/unload_lora_adapter",
                                    {"lora_name": "chat-lora"})
        assert status == 200, body
    assert cluster.sub_metric("A", "lora_drops_total") == 0


def _lora(cluster: Cluster, op: str, name: str, path: str = "") -> None:
    body = {"lora_name": name, **({"lora_path": path} if path else {})}
    status, _, resp = http_json(cluster.engines["A"].url + f"/v1/{op}_lora_adapter", body)
    assert status == 200, resp


def test_unloaded_adapters_hints_go_within_a_poll_interval_and_a_reload_starts_fresh(
    cluster: Cluster,
) -> None:
    """Issue 11 item 2: vLLM publishes no KV event on /v1/unload_lora_adapter; A's subscriber
    polls /v1/models every second and drops the adapter's partition for A once it is gone. The
    base model's and the still-loaded sql-lora's hints are untouched; the adapter loaded again
    starts from nothing and indexes what it stores from then on."""
    name, path = "item11-lora", str(cluster.assets.adapter("chat-lora"))
    _lora(cluster, "load", name, path)
    try:
        ids = cluster.serve("A", cluster.prompt("item11 adapter", blocks=4), model=name)
        base = cluster.serve("A", cluster.prompt("item11 base", blocks=4))
        sql = cluster.serve("A", cluster.prompt("item11 sql", blocks=3), model="sql-lora")
        cluster.wait_held(ids, {"A": full_blocks(len(ids))}, adapter=name)
        cluster.wait_held(base, {"A": full_blocks(len(base))})
        cluster.wait_held(sql, {"A": full_blocks(len(sql))}, adapter="sql-lora")
        forgotten = cluster.sub_metric("A", "adapters_forgotten_total")
    finally:
        _lora(cluster, "unload", name)
    t0 = time.monotonic()
    # bounded by one poll interval plus the engine's answer and the eviction's way to the index
    cluster.wait_held(ids, {}, adapter=name, timeout=ADAPTER_POLL_S + 4.0)
    cluster.timings["adapter unloaded -> its hints gone"] = time.monotonic() - t0
    # (>=: chat-lora, unloaded by the previous test, may have been dropped meanwhile too)
    assert cluster.sub_metric("A", "adapters_forgotten_total") >= forgotten + 1
    assert cluster.sub_metric("A", "adapter_blocks_forgotten_total") >= 4
    assert cluster.held(base) == {"A": full_blocks(len(base))}
    assert cluster.held(sql, adapter="sql-lora") == {"A": full_blocks(len(sql))}

    _lora(cluster, "load", name, path)
    try:
        fresh = cluster.serve("A", cluster.prompt("item11 reloaded", blocks=3), model=name)
        cluster.wait_held(fresh, {"A": full_blocks(len(fresh))}, adapter=name)
        assert cluster.held(ids, adapter=name) == {}  # the old partition does not come back
        time.sleep(2 * ADAPTER_POLL_S)  # listed again: later polls keep the new blocks
        assert cluster.held(fresh, adapter=name) == {"A": full_blocks(len(fresh))}
    finally:
        _lora(cluster, "unload", name)
    assert cluster.sub_metric("A", "adapter_polls_total", result="failed") == 0


def test_late_subscriber_learns_earlier_blocks_from_the_replay_endpoint(
    cluster: Cluster,
) -> None:
    """A subscriber started after engine A has published asks vLLM's replay ROUTER for the
    batches from seq 0 on its first live message and so knows blocks stored before it joined.
    It reports under tenant ``replay`` to keep its holds away from the other tests' lookups."""
    engine = cluster.engines["A"]
    before = cluster.serve("A", cluster.prompt("replay before", blocks=4))
    cluster.wait_held(before, {"A": full_blocks(len(before))})
    late = cluster.start_subscriber(
        "A-late", engine, "--tenant-id", "replay",
        "--replay-endpoint", engine.replay_endpoint or "", "--engine-metrics-url", "")
    try:
        assert cluster.held(before, tenant="replay") == {}
        # Nothing is replayed until a live message shows where the stream is; keep sending
        # until the late SUB is connected and one arrives.
        deadline = time.monotonic() + 30
        while cluster.sub_metric("A-late", "replays_total") < 1:
            assert time.monotonic() < deadline, "the late subscriber never requested a replay"
            cluster.serve("A", cluster.prompt("replay nudge", blocks=1), max_tokens=1)
            time.sleep(0.2)
        cluster.wait_held(before, {"A-late": full_blocks(len(before))}, tenant="replay")
        assert cluster.sub_metric("A-late", "replayed_batches_total") >= 1
        assert cluster.held(before) == {"A": full_blocks(len(before))}  # tenant default as is
    finally:
        late.stop()


def test_engine_load_stats_reach_the_server(cluster: Cluster) -> None:
    """The subscribers scrape vLLM 0.32's /metrics (prefix-cache counters, request gauges) every
    2 s; a hit rate above 0 shows the metric names match what this vLLM exports."""
    text = cluster.prompt("stats A", blocks=4)
    cluster.serve("A", text)
    deadline = time.monotonic() + 30
    rows: dict[str, Any] = {}
    while time.monotonic() < deadline:
        cluster.engines["A"].complete(text, max_tokens=1)  # keeps every scrape window hitting
        rows = {r["replicaId"]: r for r in cluster.snapshot()["replicas"]}
        if rows.get("A", {}).get("hitRate", 0) > 0 and rows.get("B", {}).get("statsReported"):
            break
        time.sleep(0.25)
    assert rows["A"].get("statsReported") and rows["A"]["hitRate"] > 0, rows
    assert rows["B"].get("statsReported"), rows
    for name in ("A", "B"):
        assert cluster.sub_metric(name, "stats_ticks_total", result="ok") >= 1
        assert cluster.sub_metric(name, "stats_ticks_total", result="scrape_failed") == 0


def test_gateway_routes_the_second_request_to_the_warm_engine(cluster: Cluster) -> None:
    """Issue 5, gateway: an OpenAI client's follow-up with a shared prefix goes where the first
    one was cached, and that engine really hits its cache."""
    gw = f"http://{cluster.start_gateway()}"

    # Completions: a long document, then the same document with a question appended.
    doc = cluster.prompt("item6 doc", blocks=6)
    status, h1, body1 = http_json(gw + "/v1/completions",
                                  {"model": MODEL_NAME, "prompt": doc, "max_tokens": 2})
    assert status == 200, body1
    warm = h1["X-Cache-Route-Replica"]
    assert warm in cluster.engines
    first = cluster.ids(doc)
    assert h1["X-Cache-Route-Prompt-Tokens"] == str(len(first))
    cluster.wait_held(first, {warm: full_blocks(len(first))})
    follow = doc + " and then what happened next to the quick brown fox"
    second = cluster.ids(follow)
    shared = _common_prefix(first, second)
    assert shared >= 3 * BLOCK
    status, h2, body2 = http_json(gw + "/v1/completions",
                                  {"model": MODEL_NAME, "prompt": follow, "max_tokens": 2})
    assert status == 200, body2
    assert (h2["X-Cache-Route-Replica"], h2["X-Cache-Route-Reason"]) == (warm, "PREFIX_MATCH")
    assert h2["X-Cache-Route-Matched-Tokens"] == str(full_blocks(shared))
    assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] >= full_blocks(shared)

    # Chat: the second turn repeats the first turn's messages (the chat template's prefix).
    messages = [{"role": "system", "content": cluster.prompt("item6 system", blocks=4)},
                {"role": "user", "content": "What does the cache hold?"}]
    status, h1, body1 = http_json(gw + "/v1/chat/completions",
                                  {"model": MODEL_NAME, "messages": messages, "max_tokens": 2})
    assert status == 200, body1
    warm = h1["X-Cache-Route-Replica"]
    first = chat_prompt_ids(cluster.tokenizer, {"messages": messages})
    assert body1["usage"]["prompt_tokens"] == len(first)  # our chat template rendering == vLLM's
    assert h1["X-Cache-Route-Prompt-Tokens"] == str(len(first))
    cluster.wait_held(first, {warm: full_blocks(len(first))})
    messages += [{"role": "assistant", "content": body1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And what happens on the second turn?"}]
    status, h2, body2 = http_json(gw + "/v1/chat/completions",
                                  {"model": MODEL_NAME, "messages": messages, "max_tokens": 2})
    assert status == 200, body2
    assert (h2["X-Cache-Route-Replica"], h2["X-Cache-Route-Reason"]) == (warm, "PREFIX_MATCH")
    matched = int(h2["X-Cache-Route-Matched-Tokens"])
    assert matched >= full_blocks(len(first)) - BLOCK
    assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] >= matched


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_engine_restart_drops_its_stale_hints_before_it_serves_again(cluster: Cluster) -> None:
    """Issue 5 item 4: stopping engine B is detected (socket-monitor disconnect, or the sequence
    going back on the first batch of the new engine), B's hints go before the new engine serves,
    and the new engine's blocks are indexed again. Runs last: it restarts B."""
    engine = cluster.engines["B"]
    stale = cluster.serve("B", cluster.prompt("item4 before", blocks=5))
    on_a = cluster.serve("A", cluster.prompt("item4 A", blocks=5))
    cluster.wait_held(stale, {"B": full_blocks(len(stale))})
    cluster.wait_held(on_a, {"A": full_blocks(len(on_a))})
    restarts_before = sum(cluster.sub_metric("B", "engine_restarts_total", cause=c)
                          for c in ("disconnect", "seq_regression"))

    engine.stop()
    t_stopped = time.monotonic()
    cluster.wait_held(stale, {})  # seen as soon as the engine's socket goes away
    cluster.timings["engine B stopped -> its hints gone"] = time.monotonic() - t_stopped
    assert cluster.held(on_a) == {"A": full_blocks(len(on_a))}  # A is untouched
    engine.start()
    engine.wait_ready()
    # Ready to serve, nothing sent yet: the stale hints are gone, and stay gone.
    assert cluster.held(stale) == {}
    restarts = {c: cluster.sub_metric("B", "engine_restarts_total", cause=c)
                for c in ("disconnect", "seq_regression")}
    assert sum(restarts.values()) == restarts_before + 1, restarts
    cluster.notes["engine B restart detected by"] = ", ".join(
        c for c, n in restarts.items() if n)

    fresh = cluster.serve("B", cluster.prompt("item4 after", blocks=5))
    cluster.wait_held(fresh, {"B": full_blocks(len(fresh))})  # the subscriber reconnected
    assert cluster.held(stale) == {}
    # The new engine indeed starts cold: the old prompt is a miss there.
    usage = engine.complete(stale)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
