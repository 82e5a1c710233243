"""Adapter lifecycle: an adapter the engine stops listing loses its holds; nothing else does
(subscriber/adapters.py; issue 11 item 2). The real-vLLM version is in tests/vllm."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from inferencecache.fingerprint import prefix_hashes
from inferencecache.kvevents import decode_batch
from inferencecache.kvevents.encode import WireEvent, WireRemoved, WireStored, encode_batch
from inferencecache.subscriber.adapters import (
    AdapterPoller,
    AdapterTracker,
    ModelsError,
    parse_models,
)
from inferencecache.web import Listener
from tests.subscriber.conftest import MapperKit

TS = 1767225600.125
MODEL = "base-model"


def run(kit: MapperKit, *events: WireEvent, fmt: str = "vllm-0.33") -> None:
    kit.mapper.apply(decode_batch(encode_batch(TS, list(events), fmt)))


def store(first: int, tokens: list[int], parent: int | None = None, **kw: Any) -> WireStored:
    kw.setdefault("medium", "GPU")
    n = len(tokens) // 16
    return WireStored(list(range(first, first + n)), parent, tokens, 16, **kw)


def toks(seed: int, blocks: int) -> list[int]:
    return [(seed * 131 + i) % 40_000 for i in range(16 * blocks)]


def vllm_listing(adapters: dict[str, str], base: str = MODEL) -> dict[str, Any]:
    """``GET /v1/models`` as vLLM 0.32 answers it (base card, then one card per adapter)."""
    data: list[dict[str, Any]] = [{"id": base, "object": "model", "root": "/models/" + base,
                                   "parent": None, "max_model_len": 1024}]
    data += [{"id": n, "object": "model", "root": root, "parent": base}
             for n, root in adapters.items()]
    return {"object": "list", "data": data}


def evicted(kit: MapperKit) -> list[tuple[bytes, str]]:
    return [(c[1], c[2]) for c in kit.outbox.calls if c[0] == "evict"]


# ---- parsing --------------------------------------------------------------------------------


def test_listing_of_vllm_and_sglang() -> None:
    assert parse_models(vllm_listing({"sql": "/a/sql", "chat": "/a/chat"}), MODEL) == {
        "sql": "/a/sql", "chat": "/a/chat"}
    # SGLang: root is the served name for the base, the path for adapters; no max_model_len
    sglang = {"object": "list", "data": [
        {"id": MODEL, "root": MODEL, "max_model_len": 4096},
        {"id": "x", "root": "/p/x", "parent": MODEL, "max_model_len": None}]}
    assert parse_models(sglang, MODEL) == {"x": "/p/x"}
    assert parse_models(vllm_listing({}), MODEL) == {}
    # an adapter whose parent is our model proves the model is served too
    assert parse_models({"data": [{"id": "x", "parent": MODEL}]}, MODEL) == {"x": ""}


@pytest.mark.parametrize("body", [
    vllm_listing({"sql": "/a"}, base="other-model"),  # another engine: never a reason to drop
    {"data": "nope"}, [], {"object": "list"}, None,
])
def test_listing_that_is_not_this_engines_is_an_error(body: Any) -> None:
    with pytest.raises(ModelsError):
        parse_models(body, MODEL)


# ---- the tracker ----------------------------------------------------------------------------


def test_unloaded_adapter_is_evicted_with_its_id_and_forgotten(kit: MapperKit) -> None:
    tracker = AdapterTracker(kit.mapper, kit.metrics)
    run(kit, store(1, toks(1, 3), lora_name="sql-lora"),
        store(10, toks(2, 2), lora_name="chat-lora"), store(20, toks(3, 2)))
    sql = [kit.mapper.lookup(h.to_bytes(8, "big")) for h in (1, 2, 3)]
    assert tracker.observe(tracker.begin(), {"sql-lora": "/a/sql", "chat-lora": "/a/chat"}) == []
    kit.outbox.take()
    assert tracker.observe(tracker.begin(), {"chat-lora": "/a/chat"}) == ["sql-lora"]
    calls = kit.outbox.calls
    assert calls[0] == ("flush",)  # pending adds go out before the evictions
    assert evicted(kit) == [(b[0], "sql-lora") for b in sql if b is not None]
    assert all(c[3] == 0 for c in calls[1:])  # at "now"
    assert kit.mapper.block_count() == 4  # chat-lora's 2 + base 2
    assert kit.value("adapters_forgotten_total") == 1
    assert kit.value("adapter_blocks_forgotten_total") == 3
    # Gone stays gone: nothing more to drop, base and chat-lora untouched.
    kit.outbox.take()
    assert tracker.observe(tracker.begin(), {"chat-lora": "/a/chat"}) == []
    assert tracker.observe(tracker.begin(), {}) == ["chat-lora"]
    assert kit.mapper.block_count() == 2
    assert {a for _, a in evicted(kit)} == {"chat-lora"}


def test_reloaded_adapter_starts_fresh(kit: MapperKit) -> None:
    tracker = AdapterTracker(kit.mapper, kit.metrics)
    run(kit, store(1, toks(1, 2), lora_name="sql-lora"))
    tracker.observe(tracker.begin(), {"sql-lora": "/v1"})
    # reloaded from another path (new weights) between two polls: same name, new root
    run(kit, store(50, toks(9, 1), lora_name="sql-lora"))
    kit.outbox.take()
    assert tracker.observe(tracker.begin(), {"sql-lora": "/v2"}) == ["sql-lora"]
    assert len(evicted(kit)) == 3
    # A store after the reload is a fresh partition: reported, tracked, droppable again.
    kit.outbox.take()
    run(kit, store(60, toks(4, 2), lora_name="sql-lora"))
    assert [e[2] for e in kit.outbox.added()] == ["sql-lora", "sql-lora"]
    assert kit.mapper.adapter_partitions()["sql-lora"][0] == "sql-lora"
    assert tracker.observe(tracker.begin(), {"sql-lora": "/v2"}) == []
    assert tracker.observe(tracker.begin(), {}) == ["sql-lora"]


def test_a_partition_stored_after_the_listing_was_asked_for_is_kept(kit: MapperKit) -> None:
    tracker = AdapterTracker(kit.mapper, kit.metrics)
    asked = tracker.begin()
    run(kit, store(1, toks(1, 2), lora_name="new-lora"))  # loaded and used meanwhile
    assert tracker.observe(asked, {}) == []  # the listing may predate the load
    assert kit.mapper.block_count() == 2
    assert tracker.observe(tracker.begin(), {}) == ["new-lora"]


def test_lora_id_only_partitions_need_their_name_listed_once() -> None:
    """An engine that sends only lora_id (named by --lora-adapter-names): a table name that the
    engine never listed is never dropped; one it listed is dropped when it disappears."""
    kit = MapperKit(names={1: "sql-lora", 2: "my-own-name"})
    tracker = AdapterTracker(kit.mapper, kit.metrics)
    run(kit, store(1, toks(1, 1), lora_id=1), store(5, toks(2, 1), lora_id=2))
    assert kit.mapper.adapter_partitions() == {
        "sql-lora": ("sql-lora", False, 1), "my-own-name": ("my-own-name", False, 1)}
    assert tracker.observe(tracker.begin(), {"sql-lora": "/a"}) == []
    assert tracker.observe(tracker.begin(), {}) == ["sql-lora"]
    assert tracker.observe(tracker.begin(), {}) == []  # my-own-name: never listed, kept
    assert kit.mapper.block_count() == 1


def test_mapped_id_uses_the_events_lora_name_as_the_engines_name() -> None:
    kit = MapperKit(names={1: "sql"})
    tracker = AdapterTracker(kit.mapper, kit.metrics)
    run(kit, store(1, toks(1, 2), lora_id=1, lora_name="sql-lora"))
    assert kit.mapper.adapter_partitions()["sql"][:2] == ("sql-lora", True)
    assert tracker.observe(tracker.begin(), {"sql-lora": "/a"}) == []
    assert tracker.observe(tracker.begin(), {"sql": "/a"}) == ["sql"]  # sql-lora is gone
    assert {a for _, a in evicted(kit)} == {"sql"}


def test_evicted_partitions_are_no_longer_tracked(kit: MapperKit) -> None:
    tracker = AdapterTracker(kit.mapper, kit.metrics)
    run(kit, store(1, toks(1, 2), lora_name="sql-lora"))
    run(kit, WireRemoved([1, 2], medium="GPU"))
    assert kit.mapper.adapter_partitions() == {}
    kit.outbox.take()
    assert tracker.observe(tracker.begin(), {}) == []
    assert evicted(kit) == []


def test_a_store_chained_to_a_forgotten_block_keeps_its_true_fingerprint(kit: MapperKit) -> None:
    """A reloaded adapter (same path) may hit its old blocks in the engine; a store chained to
    one must not be fingerprinted as a fresh chain (that would be a wrong hint)."""
    tracker = AdapterTracker(kit.mapper, kit.metrics)
    first, second = toks(1, 2), toks(2, 1)
    run(kit, store(1, first, lora_name="sql-lora"))
    tracker.observe(tracker.begin(), {})
    kit.outbox.take()
    run(kit, store(3, second, parent=2, lora_name="sql-lora"))
    want = prefix_hashes(first + second, 16)[2].to_bytes(8, "big")
    assert [(e[0], e[1]) for e in kit.outbox.added()] == [(want, 48)]
    # The engine's own eviction of a forgotten block is silent; a clear forgets them all.
    kit.outbox.take()
    run(kit, WireRemoved([1], medium="GPU"))
    assert evicted(kit) == []


# ---- the poller against a real HTTP listener ------------------------------------------------


class Engine:
    """A /v1/models endpoint on 127.0.0.1 whose answer the test sets."""

    def __init__(self) -> None:
        self.status = 200
        self.body: Any = vllm_listing({})
        self.hits = 0
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        self.listener = Listener(app)
        self.url = ""

    async def _models(self, _request: web.Request) -> web.Response:
        self.hits += 1
        text = self.body if isinstance(self.body, str) else json.dumps(self.body)
        return web.Response(status=self.status, text=text, content_type="application/json")

    async def start(self) -> None:
        port = await self.listener.start("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}/v1/models"


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    await e.start()
    try:
        yield e
    finally:
        await e.listener.stop()


async def test_poller_drops_only_on_a_good_listing(kit: MapperKit, engine: Engine) -> None:
    answered: list[float] = []
    poller = AdapterPoller(AdapterTracker(kit.mapper, kit.metrics), kit.metrics,
                           url=engine.url, model_id=MODEL, interval=60, on_answer=answered.append)
    run(kit, store(1, toks(1, 2), lora_name="sql-lora"))
    engine.body = vllm_listing({"sql-lora": "/a"})
    assert await poller.poll() == []
    assert len(answered) == 1
    engine.body = vllm_listing({}, base="someone-else")  # a URL pointing at another engine
    assert await poller.poll() is None
    engine.status, engine.body = 500, vllm_listing({})
    assert await poller.poll() is None
    engine.status, engine.body = 200, "{not json"
    assert await poller.poll() is None
    assert len(answered) == 1  # none of those counts as our engine answering
    assert kit.mapper.block_count() == 2 and evicted(kit) == []
    assert kit.value("adapter_polls_total", result="failed") == 3
    engine.body = vllm_listing({})
    assert await poller.poll() == ["sql-lora"]
    assert kit.value("adapter_polls_total", result="ok") == 2
    assert len(answered) == 2
    await poller.close()


async def test_poller_survives_a_dead_url_and_polls_every_interval(
    kit: MapperKit, engine: Engine
) -> None:
    dead = AdapterPoller(AdapterTracker(kit.mapper), kit.metrics,
                         url="http://127.0.0.1:9/v1/models", model_id=MODEL, interval=0.01,
                         timeout=1.0)
    assert await dead.poll() is None
    await dead.close()
    live = AdapterPoller(AdapterTracker(kit.mapper), kit.metrics, url=engine.url,
                         model_id=MODEL, interval=0.02)
    task = asyncio.create_task(live.run())
    try:
        for _ in range(200):
            if engine.hits >= 3:
                break
            await asyncio.sleep(0.01)
        assert engine.hits >= 3
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
