"""The processor: decode then apply, a rejected batch is one Warn and one count
(engine-events-and-subscriber.md §3.3, engine-events-and-subscriber.md §13 items 10, 16)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from inferencecache.subscriber.intake import EngineGone, QueueItem, RawBatch
from inferencecache.subscriber.processor import Processor
from tests.kvevents.util import payload
from tests.subscriber.conftest import MapperKit

MALFORMED = [
    "malformed-truncated.bin", "malformed-not-msgpack.bin", "malformed-envelope-short.bin",
    "malformed-tag-not-string.bin", "malformed-map-missing-type.bin",
    "malformed-lora-id-wrong-type-array.bin", "malformed-lora-id-wrong-type-map.bin",
    "malformed-block-size-zero.bin", "malformed-nil-block-hash.bin",
]


@pytest.mark.parametrize("name", MALFORMED)
def test_s13_16_each_rejected_batch_logs_one_warning_and_counts_once(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    kit = MapperKit()
    proc = Processor(asyncio.Queue(), kit.mapper, kit.metrics)
    assert proc.apply_payload(payload(name), seq=3) is False
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1 and warns[0].getMessage() == "dropping undecodable event batch"
    assert warns[0].seq == 3 and warns[0].err  # type: ignore[attr-defined]
    reason = warns[0].reason  # type: ignore[attr-defined]
    assert kit.value("batches_rejected_total", reason=reason) == 1
    assert kit.outbox.calls == []


async def test_s13_10_the_loop_continues_after_bad_batches_in_order() -> None:
    kit = MapperKit()
    queue: asyncio.Queue[QueueItem] = asyncio.Queue()
    proc = Processor(queue, kit.mapper, kit.metrics)
    for i, name in enumerate(MALFORMED):
        queue.put_nowait(RawBatch(i, payload(name)))
    queue.put_nowait(RawBatch(20, payload("vllm-map-v0.33-stream-00-stored-root.bin")))
    queue.put_nowait(EngineGone("disconnect"))
    queue.put_nowait(RawBatch(0, payload("vllm-map-v0.33-dp-rank-1.bin")))
    queue.put_nowait(None)
    await asyncio.wait_for(proc.run(), 5)
    assert [c[0] for c in kit.outbox.calls] == ["add", "clear", "add"]
    assert kit.value("batches_received_total") == len(MALFORMED) + 2
    assert kit.mapper.block_count() == 1
