"""Wiring of one subscriber process: tasks, start-up and graceful shutdown
(engine-events-and-subscriber.md §3.6).

Tasks on one event loop: intake (ZeroMQ) → bounded queue → processor (decode + mapper) →
forwarder's sender (gRPC), plus the connectivity watcher, the stats reporter, the refresher
(resident blocks re-reported while the engine is alive), the adapter poller (unloaded LoRA
adapters forgotten) and the HTTP listener. The gRPC channel connects lazily, so start-up never
waits for the server. The refresher and the poller read and change the mapper only between the
processor's batches (one event loop, no awaits inside the mapper), so nothing needs a lock.
Each task runs under a ``supervise.LoopSupervisor``: one that dies of an exception is restarted
after a short backoff, counted (``loop_restarts``) and reported by ``/healthz`` meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Final

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from inferencecache.config import format_duration
from inferencecache.subscriber.adapters import AdapterPoller, AdapterTracker
from inferencecache.subscriber.client import CacheClient
from inferencecache.subscriber.forwarder import Forwarder
from inferencecache.subscriber.http import MetricsServer
from inferencecache.subscriber.intake import QUEUE_SIZE, Intake, QueueItem
from inferencecache.subscriber.lora import LoraResolver
from inferencecache.subscriber.mapping import Block, BlockMapper
from inferencecache.subscriber.messages import Identity
from inferencecache.subscriber.metrics import PREFIX, SubscriberMetrics
from inferencecache.subscriber.processor import Processor
from inferencecache.subscriber.refresh import EngineLiveness, RefreshPacer, run_refresher
from inferencecache.subscriber.replay import ReplayClient
from inferencecache.subscriber.resync import watch_connectivity
from inferencecache.subscriber.settings import SubscribeSettings
from inferencecache.subscriber.stats import StatsReporter, make_profile
from inferencecache.supervise import LoopSupervisor

log = logging.getLogger("inferencecache.subscriber")

DRAIN_TIMEOUT: Final = 5.0


class Subscriber:
    """One running subscriber (``inferencecache subscribe``)."""

    def __init__(
        self,
        settings: SubscribeSettings,
        registry: CollectorRegistry | None = None,
        *,
        metrics_sock: socket.socket | None = None,
    ):
        """``metrics_sock``: ``--metrics-address`` already bound (``web.bind_tcp``, so a bind
        error is reported before start-up); ``None`` binds it in :meth:`start`."""
        self.settings = settings
        self.metrics_sock = metrics_sock
        self.metrics = SubscriberMetrics(registry)
        self.ident = Identity(
            settings.replica_id, settings.model_id, settings.tenant_id, settings.hash_scheme
        )
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.supervisor = LoopSupervisor(PREFIX, self.metrics.registry, log)
        self.http: MetricsServer | None = None
        self.ctx: zmq.asyncio.Context | None = None
        self.client: CacheClient | None = None
        self.forwarder: Forwarder | None = None
        self.mapper: BlockMapper | None = None
        self.intake: Intake | None = None
        self.liveness: EngineLiveness | None = None
        self.pacer: RefreshPacer | None = None
        self._stopping = False

    def health(self) -> str | None:
        """``None`` while every long-running task runs, else why not (``/healthz`` body)."""
        if not self._tasks or self._stopping:
            return "not running"
        ended = sorted(name for name, t in self._tasks.items() if t.done())
        if ended:
            return "not running: " + ", ".join(ended) + " ended"
        return self.supervisor.health()

    def healthy(self) -> bool:
        """True while every long-running task runs (none waits to be restarted)."""
        return self.health() is None

    def _snapshot(self) -> list[list[Block]]:
        """The mapper's state for a resync (the forwarder is built before the mapper)."""
        assert self.mapper is not None
        return self.mapper.snapshot()

    def _on_reconnect(self) -> None:
        """The channel is back (maybe to a restarted or different server): resync the resident
        state and ask the server's capabilities again."""
        if self.client is not None:
            self.client.forget_capabilities()
        if self.forwarder is not None:
            self.forwarder.request_resync()

    def _engine_paused(self, paused: bool) -> None:
        """The refresher's view of the engine flipped (logged once per flip)."""
        self.metrics.engine_alive.set(0 if paused else 1)
        if paused:
            log.warning("engine not alive; pausing the refresh of its blocks (they expire by "
                        "the server's TTL unless it comes back)")
        else:
            log.info("engine alive; refreshing its resident blocks",
                     extra={"refresh_interval": format_duration(self.settings.refresh_interval)})

    def _spawn(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``loop()`` supervised (called again if it dies of an exception)."""
        task = self.supervisor.spawn(name, loop)
        task.add_done_callback(self._task_done)
        self._tasks[name] = task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._stopping:
            return
        exc = task.exception()
        if exc is not None:
            log.error("subscriber task failed", extra={"task": task.get_name(), "err": repr(exc)})

    async def start(self) -> None:
        """Create the sockets, the channel and the tasks; bind the metrics listener."""
        s = self.settings
        log.info(
            "kvevent-subscriber starting",
            extra={
                "engine_endpoint": s.engine_endpoint,
                "server": str(s.server),
                "replica_id": s.replica_id,
                "model_id": s.model_id,
                "tenant_id": s.tenant_id,
                "hash_scheme": s.hash_scheme,
                "topic": s.topic,
                "block_size": s.block_size,
                "replay_endpoint": s.replay_endpoint,
                "engine_metrics_url": s.engine_metrics_url,
                "stats_interval": format_duration(s.effective_stats_interval),
                "cache_tier": s.cache_tier,
                "engine_model_name": s.engine_model_name,
                "ignore_block_removed": s.ignore_block_removed,
                "trust_lora_name": s.trust_lora_name,
                "batch_evictions": s.batch_evictions,
                "refresh_interval": format_duration(s.refresh_interval),
                "engine_models_url": s.engine_models_url,
                "adapter_poll_interval": format_duration(s.effective_adapter_poll_interval),
            },
        )
        self.client = CacheClient(str(s.server))
        self.ctx = zmq.asyncio.Context()
        queue: asyncio.Queue[QueueItem] = asyncio.Queue(QUEUE_SIZE)
        self.forwarder = Forwarder(
            self.client,
            self.ident,
            self.metrics,
            window=s.effective_window,
            snapshot=self._snapshot,
            batch_evictions=s.batch_evictions,
        )
        self.mapper = BlockMapper(
            block_size=s.block_size,
            resolver=LoraResolver(s.adapter_names, s.trust_lora_name),
            outbox=self.forwarder,
            metrics=self.metrics,
            ignore_block_removed=s.ignore_block_removed,
        )
        replay = ReplayClient(self.ctx, s.replay_endpoint) if s.replay_endpoint else None
        self.intake = Intake(self.ctx, s.engine_endpoint, s.topic, queue, self.metrics,
                             replay=replay)
        self.processor = Processor(queue, self.mapper, self.metrics)
        self.http = MetricsServer(self.metrics.registry, self.health)
        if self.metrics_sock is not None:
            port = await self.http.start_socket(self.metrics_sock)
        else:
            port = await self.http.start(s.metrics_address.host, s.metrics_address.port)
        log.info(
            "metrics listening",
            extra={"address": f"{s.metrics_address.host}:{port}", "paths": "/metrics /healthz"},
        )
        self._spawn("intake", self.intake.run)
        self._spawn("processor", self.processor.run)
        self._spawn("sender", self.forwarder.run)
        channel = self.client.channel
        self._spawn("connectivity", lambda: watch_connectivity(channel, self._on_reconnect))
        intake = self.intake
        self.liveness = EngineLiveness(
            s.liveness_window,
            connected=lambda: intake.connected,
            last_event=self.metrics.last_event_at,
        )
        if s.refresh_interval > 0:
            pacer = self.pacer = RefreshPacer(s.refresh_interval)
            mapper, liveness = self.mapper, self.liveness
            self._spawn("refresher", lambda: run_refresher(
                pacer, mapper, liveness, on_pause=self._engine_paused))
        if s.engine_models_url:
            poller = AdapterPoller(
                AdapterTracker(self.mapper, self.metrics),
                self.metrics,
                url=s.engine_models_url,
                model_id=s.model_id,
                interval=s.effective_adapter_poll_interval,
                on_answer=self.liveness.probe_ok,
            )
            self._spawn("adapters", poller.run)
        if s.engine_metrics_url:
            profile = make_profile(
                s.hash_scheme, s.cache_tier, s.engine_cache_size_bytes, s.max_concurrency_ceiling
            )
            stats = StatsReporter(
                self.client,
                self.ident,
                self.metrics,
                profile,
                url=s.engine_metrics_url,
                interval=s.effective_stats_interval,
                model_name=s.engine_model_name,
                on_scrape=self.liveness.probe_ok,
            )
            self._spawn("stats", stats.run)

    async def _cancel(self, name: str) -> None:
        task = self._tasks.get(name)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    async def _wait(self, name: str, timeout: float) -> bool:
        task = self._tasks.get(name)
        if task is None:
            return True
        done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout))
        return bool(done)

    async def stop(self) -> None:
        """Stop receiving, drain the queue and flush, then close everything (≤ 5 s per part)."""
        self._stopping = True
        await self._cancel("intake")
        await self._cancel("refresher")  # nothing new reaches the forwarder once it drains
        await self._cancel("adapters")
        assert self.intake is not None and self.forwarder is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_TIMEOUT
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.intake.close(), DRAIN_TIMEOUT)
        drained = await self._wait("processor", deadline - loop.time())
        self.forwarder.close()
        if drained:
            drained = await self._wait("sender", deadline - loop.time())
        if not drained:
            log.warning("reporter drain timed out")
        await self._cancel("processor")
        await self._cancel("sender")
        stats = self._tasks.get("stats")
        if stats is not None:
            stats.cancel()
            done, _ = await asyncio.wait({stats}, timeout=DRAIN_TIMEOUT)
            if not done:
                log.warning("stats reporter drain timed out")
        await self._cancel("connectivity")
        await self._close_io()
        log.info("kvevent-subscriber stopped")

    async def run(self, stop: asyncio.Event) -> None:
        """Start, wait for ``stop`` (a signal), shut down."""
        try:
            await self.start()
        except BaseException:
            await self._release()
            raise
        await stop.wait()
        await self.stop()

    async def _release(self) -> None:
        """Close what a failed start left open."""
        self._stopping = True
        for name in list(self._tasks):
            await self._cancel(name)
        await self._close_io()

    async def _close_io(self) -> None:
        """The listener, the gRPC channel and the ZeroMQ context, whichever were opened."""
        if self.http is not None:
            await self.http.stop()
        if self.client is not None:
            await self.client.close()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
