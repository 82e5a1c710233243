"""An engine-side KV-event publisher that speaks the real wire format
(engine-events-and-subscriber.md §2.1).

What vLLM's ``ZmqEventPublisher`` does, reusable by every fake or simulated engine: a PUB socket
(binds like vLLM: ``*``, ``::``, ``ipc://`` and ``inproc://`` endpoints, and here any loopback
``tcp://`` address), 3-frame messages ``topic, seq, payload`` with ``seq`` counting from 0 per
process, batches encoded in a chosen release's shape, a replay buffer of the last
``buffer_steps`` batches and, optionally, the replay ROUTER that answers ``["", start_seq]``
requests in that release's reply generation. Events of one scheduler step are collected with
:meth:`store` / :meth:`remove` / :meth:`clear` and published as one batch by :meth:`end_step`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import zmq
import zmq.asyncio

from inferencecache.kvevents.encode import (
    DEFAULT_FORMAT,
    Hash,
    WireAllCleared,
    WireEvent,
    WireFormat,
    WireRemoved,
    WireStored,
    encode_batch,
    wire_format,
)
from inferencecache.kvevents.framing import (
    live_message,
    parse_replay_request,
    replay_data,
    replay_end,
)
from inferencecache.supervise import RateLimitedLog, describe

if TYPE_CHECKING:
    from inferencecache.engines.cache import Inserted
    from inferencecache.engines.settings import FakeEngineSettings

log = logging.getLogger("inferencecache.engines")

DEFAULT_BUFFER_STEPS: Final = 10_000
DEFAULT_HWM: Final = 100_000


class BindError(Exception):
    """An endpoint could not be bound: ``which`` is ``"endpoint"`` (the PUB socket) or
    ``"replay_endpoint"`` (the replay ROUTER), ``reason`` ZeroMQ's error text."""

    def __init__(self, which: str, endpoint: str, reason: str) -> None:
        super().__init__(f"cannot bind {endpoint}: {reason}")
        self.which = which
        self.endpoint = endpoint
        self.reason = reason


class EventPublisher:
    """PUB socket + seq + replay buffer (+ replay ROUTER) for one engine (one DP rank)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        endpoint: str,
        topic: str = "",
        fmt: WireFormat | str = DEFAULT_FORMAT,
        replay_endpoint: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        rank: int = 0,
        see_subscribers: bool = False,
    ) -> None:
        self.ctx = ctx
        self.requested_endpoint = endpoint
        self.requested_replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.format = wire_format(fmt) if isinstance(fmt, str) else fmt
        self.rank = rank
        self.hwm = hwm
        # XPUB instead of PUB: identical on the wire, but subscriptions become visible, so a
        # benchmark can wait until a subscriber is really listening (ZeroMQ's slow joiner).
        self.see_subscribers = see_subscribers
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self.next_seq = 0
        self.endpoint = ""
        self.replay_endpoint = ""
        self._pub: zmq.asyncio.Socket | None = None
        self._raw_pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._step: list[WireEvent] = []
        self.batches_published = 0
        self.events_published = 0
        self.replay_errors = 0  # replay requests dropped because answering them raised

    # ---- lifecycle --------------------------------------------------------------------------

    @classmethod
    def from_settings(
        cls, ctx: zmq.asyncio.Context, s: FakeEngineSettings, *, see_subscribers: bool = False
    ) -> EventPublisher:
        """The publisher the ``fake-engine`` flags describe (every workload)."""
        return cls(
            ctx,
            endpoint=s.bind,
            topic=s.topic,
            fmt=s.wire_format,
            replay_endpoint=s.replay_endpoint,
            buffer_steps=s.buffer_steps,
            rank=s.data_parallel_rank,
            see_subscribers=see_subscribers,
        )

    def start(self) -> None:
        """Bind the PUB (and the replay ROUTER); resolves ``:*`` / ``:0`` ports. ``BindError``
        when an endpoint cannot be bound (nothing is left bound then)."""
        pub = self.ctx.socket(zmq.XPUB if self.see_subscribers else zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        try:
            self.endpoint = _bind(pub, self.requested_endpoint)
        except zmq.ZMQError as e:
            pub.close(linger=0)
            raise BindError("endpoint", self.requested_endpoint, _reason(e)) from e
        self._pub = pub
        self._raw_pub = zmq.Socket.shadow(pub.underlying)
        if self.requested_replay_endpoint:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 0)  # unlimited: never drop replayed batches
            try:
                self.replay_endpoint = _bind(router, self.requested_replay_endpoint)
            except zmq.ZMQError as e:
                router.close(linger=0)
                pub.close(linger=0)
                self._pub = self._raw_pub = None
                self.endpoint = ""
                endpoint = self.requested_replay_endpoint
                raise BindError("replay_endpoint", endpoint, _reason(e)) from e
            self._router = router
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def wait_for_subscriber(self) -> bytes:
        """With ``see_subscribers``: wait for the first subscription; returns its topic."""
        assert self._pub is not None and self.see_subscribers, "start() with see_subscribers"
        while True:
            msg = await self._pub.recv()
            if msg[:1] == b"\x01":
                return bytes(msg[1:])

    async def close(self) -> None:
        """Stop serving replay and close the sockets."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._router, self._pub):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    # ---- one scheduler step -----------------------------------------------------------------

    def store(
        self,
        block_hashes: Sequence[Hash],
        parent_block_hash: Hash | None,
        token_ids: list[int],
        block_size: int,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        medium: str | None = "GPU",
        group_idx: int | None = 0,
        kind: str | None = "full_attention",
    ) -> None:
        """Queue a BlockStored (fields this release does not declare are simply not written)."""
        self._step.append(
            WireStored(
                list(block_hashes),
                parent_block_hash,
                token_ids,
                block_size,
                lora_id=lora_id,
                medium=medium,
                lora_name=lora_name,
                extra_keys=[[lora_name] if lora_name else None for _ in block_hashes],
                group_idx=group_idx,
                kv_cache_spec_kind=kind,
            )
        )

    def remove(self, block_hashes: Sequence[Hash], *, medium: str | None = "GPU",
               group_idx: int | None = 0) -> None:
        """Queue a BlockRemoved."""
        self._step.append(WireRemoved(list(block_hashes), medium=medium, group_idx=group_idx))

    def publish_inserted(
        self,
        ins: Inserted,
        block_size: int,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        medium: str | None = "GPU",
    ) -> None:
        """Queue what serving one prompt did to the cache: one BlockRemoved per evicted block,
        then one BlockStored of the newly cached blocks (if any)."""
        for h in ins.evicted:
            self.remove([h], medium=medium)
        if ins.stored:
            self.store(ins.stored, ins.parent, ins.stored_tokens, block_size,
                       lora_id=lora_id, lora_name=lora_name, medium=medium)

    def clear(self) -> None:
        """Queue an AllBlocksCleared."""
        self._step.append(WireAllCleared())

    def add(self, event: WireEvent) -> None:
        """Queue any wire event as is."""
        self._step.append(event)

    @property
    def step_events(self) -> int:
        return len(self._step)

    def end_step(self, ts: float | None = None, *, live: bool = True) -> int | None:
        """Publish the queued events as one batch; ``None`` if the step had no events."""
        payload = self.encode_step(ts)
        return None if payload is None else self.publish_payload(payload, live=live)

    def encode_step(self, ts: float | None = None) -> bytes | None:
        """Encode the queued events as one batch payload without publishing it (a caller may
        publish it later with :meth:`publish_payload`); ``None`` if the step had no events."""
        if not self._step:
            return None
        events, self._step = self._step, []
        self.events_published += len(events)
        return encode_batch(time.time() if ts is None else ts, events, self.format, self.rank)

    def publish_payload(self, payload: bytes, *, live: bool = True) -> int:
        """Give ``payload`` the next seq, buffer it for replay and (if ``live``) send it.

        ``live=False`` stands in for a message the PUB dropped at its high-water mark: the
        subscriber sees a gap that only replay can fill.
        """
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        self.batches_published += 1
        if live:
            assert self._raw_pub is not None, "start() first"
            self._raw_pub.send_multipart(live_message(self.topic, seq, payload))
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the PUB (tests: malformed messages)."""
        assert self._raw_pub is not None, "start() first"
        self._raw_pub.send_multipart(frames)

    # ---- replay -----------------------------------------------------------------------------

    async def _serve_replay(self) -> None:
        """Answer replay requests until cancelled; one that makes anything raise is dropped,
        counted (``replay_errors``) and logged rate-limited."""
        router = self._router
        assert router is not None
        limited = RateLimitedLog(log)
        while True:
            frames = await router.recv_multipart()
            try:
                await self._answer_replay(router, frames, limited)
            except Exception as e:
                self.replay_errors += 1
                limited(logging.WARNING, "replay-error", "replay request dropped",
                        err=describe(e))

    async def _answer_replay(
        self, router: zmq.asyncio.Socket, frames: list[bytes], limited: RateLimitedLog
    ) -> None:
        with_topic = self.format.replay_topic_frame
        request = parse_replay_request(frames)
        if request is None:
            limited(logging.WARNING, "replay-malformed", "ignoring malformed replay request",
                    frames=len(frames))
            return
        identity, start = request
        sent = 0
        for seq, payload in list(self.buffer):
            if seq >= start:
                await router.send_multipart(
                    replay_data(identity, self.topic, seq, payload, with_topic)
                )
                sent += 1
        await router.send_multipart(replay_end(identity, with_topic))
        log.info("served replay", extra={"start_seq": start, "batches": sent})


def _reason(e: zmq.ZMQError) -> str:
    """ZeroMQ's error text without pyzmq's ``(addr=...)`` suffix (the caller names the address)."""
    return zmq.strerror(e.errno) if e.errno is not None else str(e)


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind, accepting port 0 as "any free port"; returns the endpoint actually bound."""
    target = endpoint
    if target.startswith("tcp://") and target.endswith(":0"):
        target = target[:-2] + ":*"
    sock.bind(target)
    last: Any = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)
