"""ZeroMQ intake (engine-events-and-subscriber.md §3.1, §3.2): SUB socket, frame checks, sequence,
replay.

One task owns the SUB socket and its monitor. It checks every message's shape (exactly 3 frames,
an 8-byte seq), classifies the seq, fills gaps by replay when configured, and hands payloads to
the processor through a bounded queue, in order, together with ``EngineGone`` markers for engine
restarts. A restart is seen two ways: the seq going back, or [NEW] the socket monitor reporting a
disconnect from the publisher (libzmq reconnects silently, so a restarted engine whose first
visible seq is already past ours would otherwise look like a mere gap). Messages received before
a disconnect are drained first, so the stopped engine's last batches never outlive the clear.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from inferencecache.kvevents.framing import FrameError, parse_live
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.replay import ReplayClient
from inferencecache.subscriber.sequence import Seq, SequenceTracker

log = logging.getLogger("inferencecache.subscriber")

QUEUE_SIZE: Final = 256  # batches between intake and processor
RECONNECT_BACKOFF: Final = 1.0
RCVHWM: Final = 100_000
DRAIN_MAX: Final = 512  # messages per wake-up before the monitor gets a look


@dataclass(frozen=True, slots=True)
class RawBatch:
    """One payload to decode, in stream order."""

    seq: int
    payload: bytes
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class EngineGone:
    """The engine restarted or disconnected: clear its state before the next batch."""

    cause: str  # "seq_regression" | "disconnect"


QueueItem = RawBatch | EngineGone | None


def clamp_backoff(seconds: float) -> float:
    """The dial/receive retry backoff; non-positive values mean 1 s."""
    return seconds if seconds > 0 else RECONNECT_BACKOFF


class Intake:
    """Receives engine messages and feeds the processor queue."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        topic: str,
        queue: asyncio.Queue[QueueItem],
        metrics: SubscriberMetrics,
        *,
        replay: ReplayClient | None = None,
        backoff: float = RECONNECT_BACKOFF,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.queue = queue
        self.metrics = metrics
        self.replay = replay
        self.backoff = clamp_backoff(backoff)
        self.tracker = SequenceTracker()
        self._connected = False
        self.subscribed = asyncio.Event()

    @property
    def connected(self) -> bool:
        """Whether the SUB socket is connected to the engine now (its monitor's view)."""
        return self._connected

    async def run(self) -> None:
        """Dial, receive, redial on errors; returns only when cancelled."""
        while True:
            sock: zmq.asyncio.Socket | None = None
            mon: zmq.asyncio.Socket | None = None
            try:
                sock = self.ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, RCVHWM)
                mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
                sock.connect(self.endpoint)
                sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            except zmq.ZMQError as e:
                log.warning("zmq dial failed; retrying", extra={"err": str(e)})
                _close(sock, mon)
                await asyncio.sleep(self.backoff)
                continue
            log.info(
                "subscribed to engine KV events",
                extra={"endpoint": self.endpoint, "topic": self.topic.decode(errors="replace")},
            )
            self.tracker.reset()
            self._connected = False
            self.subscribed.set()
            try:
                await self._receive(sock, mon)
            except zmq.ZMQError as e:
                log.warning("zmq recv failed; reconnecting", extra={"err": str(e)})
            finally:
                self.subscribed.clear()
                _close(sock, mon)
            await asyncio.sleep(self.backoff)

    async def _receive(self, sock: zmq.asyncio.Socket, mon: zmq.asyncio.Socket) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        raw_mon: zmq.Socket[bytes] = zmq.Socket.shadow(mon.underlying)
        while True:
            ready = dict(await poller.poll())
            if sock in ready:
                await self._drain(raw, DRAIN_MAX)
            if mon in ready:
                while True:
                    try:
                        event = parse_monitor_message(raw_mon.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    kind = event["event"]
                    if kind == zmq.EVENT_CONNECTED:
                        if not self._connected:
                            log.info("connected to the engine", extra={"endpoint": self.endpoint})
                        self._connected = True
                    elif kind == zmq.EVENT_DISCONNECTED and self._connected:
                        self._connected = False
                        await self._drain(raw, None)  # what the old engine sent comes first
                        await self.engine_gone("disconnect")

    async def _drain(self, raw: zmq.Socket[bytes], limit: int | None) -> None:
        n = 0
        while limit is None or n < limit:
            try:
                frames = raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            n += 1
            await self.handle(frames)

    async def engine_gone(self, cause: str) -> None:
        """Clear the engine's state downstream; the next message is the first of a new stream."""
        self.tracker.reset()
        self.metrics.engine_restarts[cause].inc()
        log.warning(
            "engine went away; clearing its blocks",
            extra={"cause": cause, "endpoint": self.endpoint},
        )
        await self.queue.put(EngineGone(cause))

    async def handle(self, frames: list[bytes]) -> None:
        """Check one live message and queue it (plus replayed batches before it). Whatever it
        makes raise drops it (``dropped_inputs{loop="intake"}``); the next one is read."""
        try:
            await self._handle(frames)
        except Exception as e:
            self.metrics.drops.drop("intake", e, frames=len(frames))

    async def _handle(self, frames: list[bytes]) -> None:
        m = self.metrics
        try:
            _topic, seq, payload = parse_live(frames)
        except FrameError as e:
            m.frames_malformed[e.reason].inc()
            log.warning("dropping malformed ZeroMQ message", extra={"err": str(e)})
            return
        m.mark_event()
        verdict = self.tracker.observe(seq)
        if verdict.kind is Seq.GAP:
            assert verdict.last is not None
            m.seq_gaps.inc()
            m.seq_gap_batches.inc(verdict.missed)
            log.warning(
                "engine event sequence gap",
                extra={"last_seq": verdict.last, "seq": seq, "missed": verdict.missed},
            )
            recovered = await self._replay(verdict.last + 1, seq) if self.replay else 0
            if verdict.missed > recovered:
                m.missed_batches.inc(verdict.missed - recovered)
        elif verdict.kind is Seq.RESTART:
            m.engine_restarts["seq_regression"].inc()
            log.warning(
                "engine publisher restarted (sequence went back); clearing its blocks",
                extra={"last_seq": verdict.last, "seq": seq},
            )
            await self.queue.put(EngineGone("seq_regression"))
            if self.replay and seq > 0:
                await self._replay(0, seq)
        elif verdict.kind is Seq.FIRST and self.replay and seq > 0:
            # A late joiner: learn what the engine stored before we connected.
            await self._replay(0, seq)
        await self.queue.put(RawBatch(seq, payload))

    async def _replay(self, start: int, stop: int) -> int:
        assert self.replay is not None
        self.metrics.replays.inc()
        try:
            got = await self.replay.fetch(start, stop)
        except Exception as e:  # the live message that asked for it is still queued
            self.metrics.drops.drop("replay", e, start_seq=start)
            return 0
        for seq, payload in got:
            await self.queue.put(RawBatch(seq, payload, replayed=True))
        if got:
            self.metrics.replayed_batches.inc(len(got))
        log.info(
            "replayed engine batches",
            extra={"start_seq": start, "stop_seq": stop, "received": len(got)},
        )
        return len(got)

    async def close(self) -> None:
        """Tell the processor no more input will come."""
        await self.queue.put(None)


def _close(sock: zmq.asyncio.Socket | None, mon: zmq.asyncio.Socket | None) -> None:
    if sock is not None and not sock.closed:
        if mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
        sock.close(linger=0)
    if mon is not None and not mon.closed:
        mon.close(linger=0)
