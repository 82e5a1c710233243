"""The processor task: decode queued payloads and apply them to the mapper, in order.

Decoding lives here rather than in the intake so a burst of messages is read off the socket
(into the bounded queue) while earlier ones are still being applied. A rejected batch is logged
once, counted once and skipped; nothing of it is applied. During a burst the queued batches are
applied back to back for up to ``BURST_BUDGET`` seconds before the loop yields to the intake and
the sender: one event-loop round trip per batch cost more than decoding a small batch. Anything
else a batch makes the decoder or the mapper raise drops that batch (counted in
``dropped_inputs{loop="processor"}``, logged rate-limited); the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from inferencecache.kvevents.decode import BatchDecoder, BatchRejected
from inferencecache.subscriber.intake import EngineGone, QueueItem
from inferencecache.subscriber.mapping import BlockMapper
from inferencecache.subscriber.metrics import SubscriberMetrics

log = logging.getLogger("inferencecache.subscriber")

BURST_BUDGET: Final = 0.002  # seconds of queued batches applied before yielding


class Processor:
    """Single owner of the mapper state: no locks needed."""

    def __init__(
        self,
        queue: asyncio.Queue[QueueItem],
        mapper: BlockMapper,
        metrics: SubscriberMetrics,
        decoder: BatchDecoder | None = None,
    ) -> None:
        self.queue = queue
        self.mapper = mapper
        self.metrics = metrics
        self.decoder = decoder if decoder is not None else BatchDecoder()

    def apply_payload(self, payload: bytes, seq: int | None = None) -> bool:
        """Decode and apply one payload; ``False`` if the batch was rejected."""
        self.metrics.batches_received.inc()
        try:
            batch = self.decoder.decode(payload)
        except BatchRejected as e:
            self.metrics.batches_rejected[e.reason].inc()
            log.warning(
                "dropping undecodable event batch",
                extra={"err": str(e), "reason": e.reason, "seq": seq, "bytes": len(payload)},
            )
            return False
        except Exception as e:  # a decoder bug: this batch only
            self.metrics.drops.drop("processor", e, seq=seq, bytes=len(payload))
            return False
        try:
            self.mapper.apply(batch)
        except Exception as e:  # a mapper bug: the batch's earlier events stay applied
            self.metrics.drops.drop("processor", e, seq=seq, bytes=len(payload))
            return False
        return True

    async def run(self) -> None:
        """Consume until the intake closes the queue (``None``)."""
        queue = self.queue
        clock = time.monotonic
        while True:
            item = await queue.get()
            deadline = clock() + BURST_BUDGET
            while True:
                if item is None:
                    return
                if isinstance(item, EngineGone):
                    try:
                        self.mapper.engine_restarted()
                    except Exception as e:
                        self.metrics.drops.drop("processor", e, item=item.cause)
                else:
                    self.apply_payload(item.payload, item.seq)
                if queue.empty() or clock() > deadline:
                    break
                item = queue.get_nowait()
            if not queue.empty():
                # Let the intake and the sender run between slices of a burst.
                await asyncio.sleep(0)
