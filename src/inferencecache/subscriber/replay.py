"""Replay client (engine-events-and-subscriber.md §2.1, §3.2): fill a sequence gap from the engine's
buffer.

Uses DEALER, never REQ (a REQ socket takes one reply per request and loses the rest), sends
``["", start_seq]`` and reads both reply generations until the end marker, the last wanted seq,
or the deadline (the engine's ROUTER may silently drop the tail, end marker included, so the
wait is always bounded). A fresh socket per request keeps late replies of a timed-out request
from leaking into the next one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

import zmq
import zmq.asyncio

from inferencecache.kvevents.framing import (
    ReplayData,
    ReplayEnd,
    parse_replay_reply,
    replay_request,
)

log = logging.getLogger("inferencecache.subscriber")

REPLAY_TIMEOUT: Final = 1.0


class ReplayClient:
    """Requests replays from one engine ROUTER endpoint."""

    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, timeout: float = REPLAY_TIMEOUT
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout = timeout

    async def fetch(self, start: int, stop: int) -> list[tuple[int, bytes]]:
        """Replayed ``(seq, payload)`` with ``start <= seq < stop``, increasing, within the
        deadline. Errors are logged and yield what was received so far."""
        out: list[tuple[int, bytes]] = []
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            sock.connect(self.endpoint)
            await sock.send_multipart(replay_request(start))
            last = start - 1
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    log.warning(
                        "replay timed out",
                        extra={"start_seq": start, "received": len(out)},
                    )
                    break
                if not await sock.poll(int(remaining * 1000) + 1):
                    continue
                reply = parse_replay_reply(await sock.recv_multipart())
                if reply is None:
                    continue
                if isinstance(reply, ReplayEnd):
                    break
                assert isinstance(reply, ReplayData)
                if reply.seq >= stop:
                    break
                if reply.seq > last:
                    out.append((reply.seq, reply.payload))
                    last = reply.seq
                    if last == stop - 1:
                        break
        except zmq.ZMQError as e:
            log.warning("replay request failed", extra={"err": str(e), "start_seq": start})
        finally:
            sock.close(linger=0)
        return out
