"""The three live vLLM 0.32 captures fed frame by frame through intake → processor → mapper
(engine-events-and-subscriber.md §12, §13 items 74-77)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import zmq.asyncio

from inferencecache.subscriber.intake import EngineGone, Intake, QueueItem, RawBatch
from inferencecache.subscriber.processor import Processor
from tests.kvevents.util import capture
from tests.subscriber.conftest import MapperKit

LIVE = "vllm-cpu-0.32-live-capture.jsonl"
STATIC = "vllm-cpu-0.32-lora-static-capture.jsonl"
RUNTIME = "vllm-cpu-0.32-lora-runtime-capture.jsonl"
LORA_HASHES = ["9606f0e1db62b1c7", "e085a56e043d3697", "a8f46debe089aab8"]


async def feed(kit: MapperKit, name: str) -> dict[int, list[tuple[Any, ...]]]:
    """Every captured frame set through the real intake checks and processor; outbox calls
    per seq."""
    ctx = zmq.asyncio.Context()
    queue: asyncio.Queue[QueueItem] = asyncio.Queue()
    intake = Intake(ctx, "tcp://127.0.0.1:1", "", queue, kit.metrics)
    processor = Processor(queue, kit.mapper, kit.metrics)
    out: dict[int, list[tuple[Any, ...]]] = {}
    try:
        for frame in capture(name):
            await intake.handle([frame["topic"].encode(), frame["seq"].to_bytes(8, "big"),
                                 frame["payload"]])
            while not queue.empty():
                item = queue.get_nowait()
                if isinstance(item, RawBatch):
                    processor.apply_payload(item.payload, item.seq)
                else:
                    assert isinstance(item, EngineGone)
                    kit.mapper.engine_restarted()
            out[frame["seq"]] = kit.outbox.take()
    finally:
        ctx.destroy(linger=0)
    return out


def added(calls: list[tuple[Any, ...]]) -> list[tuple[str, int, str]]:
    return [(e[0].hex(), e[1], e[2]) for c in calls if c[0] == "add" for e in c[1]]


def kinds(calls: list[tuple[Any, ...]]) -> list[str]:
    return [c[0] for c in calls]


def warns(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_s13_74_live_capture_at_block_size_32(caplog: pytest.LogCaptureFixture) -> None:
    kit = MapperKit(block_size=32)
    by_seq = await feed(kit, LIVE)
    assert sorted(by_seq) == [14, 15, 16, 17, 18]
    assert kit.value("seq_gaps_total") == 0 and kit.value("engine_restarts_total",
                                                          cause="seq_regression") == 0
    a14 = added(by_seq[14])
    assert a14 == [("6f313efce1e62d6b", 32, "")]
    a15 = added(by_seq[15])
    assert len(a15) == 25 and a15[0][0] == "1ba2b0d0533e30f5"
    assert [x[1] for x in a15] == list(range(32, 801, 32))
    c16 = by_seq[16]
    assert kinds(c16).count("evict") == 6
    last_evict = max(i for i, c in enumerate(c16) if c[0] == "evict")
    assert all(c[0] != "add" for c in c16[:last_evict])
    a16 = added(c16)
    assert len(a16) == 26 and a16[0][0] == "54af6ff3f8015d31"
    assert [x[1] for x in a16] == list(range(32, 833, 32))
    c17 = by_seq[17]
    assert kinds(c17).count("evict") == 26
    a17 = added(c17)
    assert len(a17) == 26 and a17[0][0] == "46ccf353345e0d9f"
    c18 = by_seq[18]
    assert kinds(c18)[0] == "clear"
    assert [(x[1], x[2]) for x in added(c18)] == [(32, ""), (64, ""), (96, "")]
    assert added(c18)[0][0] == "cf3471f78b967240"
    assert sum(kit.value("batches_rejected_total", reason=r) for r in
               ("msgpack", "envelope", "event", "block_hashes", "token_ids", "block_size",
                "lora_id")) == 0
    assert warns(caplog) == []


async def test_s13_75_live_capture_at_the_default_block_size() -> None:
    kit = MapperKit(block_size=16)
    by_seq = await feed(kit, LIVE)
    calls = [c for seq in sorted(by_seq) for c in by_seq[seq]]
    assert kinds(calls) == ["clear"]
    assert kit.value("events_ignored_total", reason="block_size") == 5


async def test_s13_76_static_lora_capture_without_a_map() -> None:
    kit = MapperKit(block_size=32, names={})
    by_seq = await feed(kit, STATIC)
    assert added(by_seq[0]) == [(h, 32 * (i + 1), "") for i, h in enumerate(LORA_HASHES)]
    assert added(by_seq[1]) == [(h, 32 * (i + 1), "sql-lora") for i, h in enumerate(LORA_HASHES)]


@pytest.mark.parametrize(
    ("names", "trust"), [({}, True), ({1: "sql-lora", 2: "chat-lora"}, False)],
    ids=["default", "strict-with-map"],
)
async def test_s13_77_runtime_lora_capture(names: dict[int, str], trust: bool) -> None:
    kit = MapperKit(block_size=32, names=names, trust_lora_name=trust)
    by_seq = await feed(kit, RUNTIME)
    for seq, adapter in ((0, "chat-lora"), (1, "sql-lora"), (2, "")):
        assert added(by_seq[seq]) == [(h, 32 * (i + 1), adapter)
                                      for i, h in enumerate(LORA_HASHES)]


async def test_s13_77_runtime_lora_capture_strict_without_map(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kit = MapperKit(block_size=32, names={}, trust_lora_name=False)
    by_seq = await feed(kit, RUNTIME)
    assert added(by_seq[0]) == [] and added(by_seq[1]) == []
    assert [x[2] for x in added(by_seq[2])] == ["", "", ""]
    lora_warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.lora_id for r in lora_warns] == [2, 1]  # type: ignore[attr-defined]
