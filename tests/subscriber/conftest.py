"""Helpers for subscriber tests: a recording outbox and a mapper factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from inferencecache.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch
from inferencecache.subscriber.lora import LoraResolver
from inferencecache.subscriber.mapping import BlockMapper
from inferencecache.subscriber.messages import Entry
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.tiers import tier_name
from tests.subscriber.recorder import RecordingServer

NAMES = {1: "sql-lora", 2: "chat-lora"}


class RecordingOutbox:
    """Implements ``mapping.Outbox`` by recording every call in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def add_many(self, entries: list[Entry], ts_us: int) -> None:
        self.calls.append(("add", list(entries), ts_us))

    def flush(self) -> None:
        self.calls.append(("flush",))

    def report(self, entries: list[Entry], ts_us: int) -> None:
        self.calls.append(("report", list(entries), ts_us))

    def evict(self, prefix: bytes, adapter: str, ts_us: int) -> None:
        self.calls.append(("evict", prefix, adapter, ts_us))

    def clear(self, ts_us: int) -> None:
        self.calls.append(("clear", ts_us))

    def refresh(self, entries: list[Entry]) -> None:
        self.calls.append(("refresh", list(entries)))

    def take(self) -> list[tuple[Any, ...]]:
        out, self.calls = self.calls, []
        return out

    def added(self) -> list[Entry]:
        return [e for c in self.calls if c[0] == "add" for e in c[1]]


def entry_json(e: Entry) -> dict[str, Any]:
    return {"prefix_hash": e[0].hex(), "token_count": e[1], "adapter_id": e[2],
            "tier": tier_name(e[3])}


def event_results(mapper: BlockMapper, outbox: RecordingOutbox,
                  batch: DecodedBatch) -> list[dict[str, Any]]:
    """Apply a batch event by event and describe each like the manifest's ``expected``."""
    out: list[dict[str, Any]] = []
    for ev in batch.events:
        outbox.take()
        mapper.apply(DecodedBatch(batch.ts, [ev]))
        calls = outbox.take()
        reports = [entry_json(e) for c in calls if c[0] in ("add", "report") for e in c[1]]
        if isinstance(ev, BlockStored):
            out.append({"event": "BlockStored", "report": reports})
        elif isinstance(ev, BlockRemoved):
            evict = [{"prefix_hash": c[1].hex(), "adapter_id": c[2]} for c in calls
                     if c[0] == "evict"]
            out.append({"event": "BlockRemoved", "report": reports, "evict": evict})
        else:
            assert isinstance(ev, AllBlocksCleared)
            assert [c[0] for c in calls] == ["clear"]
            out.append({"event": "AllBlocksCleared", "publish": "ALL_CLEARED"})
    return out


class MapperKit:
    def __init__(self, **kw: Any) -> None:
        names = kw.pop("names", NAMES)
        trust = kw.pop("trust_lora_name", True)
        self.metrics = SubscriberMetrics()
        self.outbox = RecordingOutbox()
        self.resolver = LoraResolver(names, trust)
        self.mapper = BlockMapper(
            block_size=kw.pop("block_size", 16),
            resolver=self.resolver,
            outbox=self.outbox,
            metrics=self.metrics,
            ignore_block_removed=kw.pop("ignore_block_removed", False),
        )
        assert not kw

    def value(self, name: str, **labels: str) -> float:
        v = self.metrics.registry.get_sample_value(
            "inferencecache_subscriber_" + name, labels or None
        )
        return 0.0 if v is None else v


@pytest.fixture
def kit() -> MapperKit:
    return MapperKit()


@pytest.fixture
async def server() -> AsyncIterator[RecordingServer]:
    async with RecordingServer() as srv:
        yield srv


@pytest.fixture(params=[True, False], ids=["batched", "per-block"])
def batch(request: pytest.FixtureRequest) -> bool:
    """``--batch-evictions``: both modes must keep every ordering rule."""
    return bool(request.param)
