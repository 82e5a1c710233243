"""The upstream engines: health, in-flight counts, and which models each one serves.

Health: every engine has a watcher task probing ``GET /health`` (any status below 500 counts as
up, so an engine without the path is not penalised). A healthy engine is probed every
``interval``; a down one after a backoff that doubles from ``min(0.5 s, interval)`` to
``backoff_max``. A request that cannot connect marks its engine down at once (the request moves
on to another engine) and wakes the watcher; a 5xx answer or a dropped connection only wakes the
watcher for an early probe, because one failing request must not take an engine out of
rotation, only a failing engine must. Probes are at least ``MIN_PROBE_GAP`` apart.

Models: on a successful probe the watcher also reads ``GET /v1/models`` (at most every
``MODELS_REFRESH``), learning the models each engine serves and, from vLLM's ``parent`` field,
which of them are LoRA adapters of which base model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from inferencecache.gateway.metrics import GatewayMetrics
from inferencecache.gateway.settings import EngineSpec

log = logging.getLogger("inferencecache.gateway")

MIN_PROBE_GAP: Final = 0.2
MODELS_REFRESH: Final = 30.0


@dataclass
class Engine:
    """One upstream replica and what the gateway knows about it."""

    replica_id: str
    base_url: str
    healthy: bool = True
    in_flight: int = 0
    models: frozenset[str] | None = None  # served model names; None until discovered
    parents: dict[str, str] = field(default_factory=dict)  # adapter -> base model
    models_at: float = 0.0
    last_probe: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, path: str) -> str:
        return self.base_url + path


class EnginePool:
    """Health-checked engines; all methods run on the event loop thread."""

    def __init__(
        self,
        specs: list[EngineSpec],
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        *,
        interval: float,
        timeout: float,
        backoff_max: float,
        discover_models: bool = True,
        static_adapters: Mapping[str, str] | None = None,
    ) -> None:
        self.engines: dict[str, Engine] = {
            s.replica_id: Engine(s.replica_id, s.url) for s in specs
        }
        self.ids = sorted(self.engines)
        self._session = session
        self._metrics = metrics
        self.interval = interval
        self.timeout = timeout
        self.backoff_min = min(0.5, interval)
        self.backoff_max = max(backoff_max, self.backoff_min)
        self.discover_models = discover_models
        self.static_adapters = dict(static_adapters or {})
        self._tasks: list[asyncio.Task[None]] = []
        for rid in self.ids:
            metrics.engine_up(rid).set(1)
            metrics.in_flight(rid).set(0)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Probe every engine once (bounded by the probe timeout), then keep watching."""
        await asyncio.gather(*(self._probe_guarded(e) for e in self.engines.values()))
        self._tasks = [
            self._metrics.loops.spawn(f"health-{e.replica_id}", functools.partial(self._watch, e))
            for e in self.engines.values()
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        self._tasks = []

    # -- routing view ----------------------------------------------------------------------------

    def healthy_ids(self, model: str | None = None) -> list[str]:
        """Sorted ids of healthy engines that serve ``model`` (or may: not yet discovered)."""
        return [
            rid
            for rid in self.ids
            if self.engines[rid].healthy and (model is None or self.serves(rid, model))
        ]

    def serves(self, rid: str, model: str) -> bool:
        e = self.engines[rid]
        if e.models is None or model in e.models:
            return True
        base = self.static_adapters.get(model)
        return base is not None and base in e.models

    def load(self) -> dict[str, int]:
        return {rid: e.in_flight for rid, e in self.engines.items()}

    def resolve(self, model: str) -> tuple[str, str] | None:
        """``model`` as (base model id, adapter id) for LookupRoute; None if nobody serves it.

        An engine whose model list is not known yet (discovery off, or down since start) might
        serve anything, so while one exists an unknown model passes through as a base model.
        """
        base = self.static_adapters.get(model)
        if base is not None:
            return base, model
        for rid in self.ids:
            parent = self.engines[rid].parents.get(model)
            if parent is not None:
                return parent, model
        engines = self.engines.values()
        if any(e.models is None or model in e.models for e in engines):
            return model, ""
        return None

    def models_payload(self) -> list[dict[str, Any]]:
        """Placeholder entries for models known only from --adapters (used by /v1/models)."""
        return [
            {"id": name, "object": "model", "owned_by": "inferencecache", "parent": base}
            for name, base in sorted(self.static_adapters.items())
        ]

    # -- request feedback ------------------------------------------------------------------------

    def begin(self, rid: str) -> None:
        e = self.engines[rid]
        e.in_flight += 1
        self._metrics.in_flight(rid).set(e.in_flight)

    def end(self, rid: str) -> None:
        e = self.engines[rid]
        e.in_flight -= 1
        self._metrics.in_flight(rid).set(e.in_flight)

    def mark_down(self, rid: str, why: str) -> None:
        """The engine refused a connection: skip it until a probe succeeds."""
        e = self.engines[rid]
        self._set_down(e, "engine down; skipping it", why)
        e.wake.set()

    def _set_down(self, e: Engine, message: str, why: str) -> None:
        """Take a healthy engine out of rotation (logged once per transition)."""
        if e.healthy:
            log.warning(message, extra={"replica": e.replica_id, "reason": why})
            e.healthy = False
            self._metrics.engine_up(e.replica_id).set(0)

    def suspect(self, rid: str) -> None:
        """Something went wrong on a request: probe the engine early, let the probe decide."""
        self.engines[rid].wake.set()

    # -- probing ---------------------------------------------------------------------------------

    async def _watch(self, e: Engine) -> None:
        backoff = self.backoff_min
        while True:
            delay = self.interval if e.healthy else backoff
            backoff = self.backoff_min if e.healthy else min(backoff * 2, self.backoff_max)
            # asyncio.timeout, not wait_for: 3.11's wait_for can lose a cancel that races
            # its own timeout, and stop() would then wait for this task forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await e.wake.wait()
            e.wake.clear()
            gap = MIN_PROBE_GAP - (time.monotonic() - e.last_probe)
            if gap > 0:
                await asyncio.sleep(gap)
            await self._probe_guarded(e)

    async def _probe_guarded(self, e: Engine) -> None:
        """One probe; whatever the engine's answers make raise is counted and logged
        (``dropped_inputs{loop="health"}``, rate-limited), and the watcher goes on."""
        try:
            await self._probe(e)
        except Exception as err:
            self._metrics.drops.drop("health", err, replica=e.replica_id)

    async def _probe(self, e: Engine) -> None:
        e.last_probe = time.monotonic()
        ok = False
        why = ""
        try:
            async with self._session.get(
                e.url("/health"), timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as resp:
                await resp.read()
                ok = resp.status < 500
                why = f"status {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            why = type(err).__name__
        if not ok:
            self._metrics.upstream_errors(e.replica_id, "health").inc()
            self._set_down(e, "engine failed its health probe; skipping it", why)
            return
        if not e.healthy:
            log.info("engine healthy again", extra={"replica": e.replica_id})
        e.healthy = True
        self._metrics.engine_up(e.replica_id).set(1)
        if self.discover_models and (
            e.models is None or time.monotonic() - e.models_at > MODELS_REFRESH
        ):
            await self._discover(e)

    async def _model_entries(self, e: Engine) -> list[dict[str, Any]] | None:
        """The dict entries of ``e``'s ``GET /v1/models`` ``data``; None if that failed."""
        try:
            async with self._session.get(
                e.url("/v1/models"), timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as resp:
                if resp.status != 200:
                    return None
                payload = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, RecursionError):
            return None
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            return None
        return [d for d in data if isinstance(d, dict)]

    async def _discover(self, e: Engine) -> None:
        data = await self._model_entries(e)
        if data is None:
            return
        models: set[str] = set()
        parents: dict[str, str] = {}
        for entry in data:
            if not isinstance(entry.get("id"), str):
                continue
            models.add(entry["id"])
            parent = entry.get("parent")
            if isinstance(parent, str) and parent and parent != entry["id"]:
                parents[entry["id"]] = parent
        if e.models is None or set(e.models) != models:
            log.info(
                "engine models",
                extra={"replica": e.replica_id, "models": sorted(models), "adapters": parents},
            )
        e.models = frozenset(models)
        e.parents = parents
        e.models_at = time.monotonic()

    async def fetch_models(self) -> list[dict[str, Any]]:
        """``/v1/models`` entries of every healthy engine, merged by id (live)."""
        healthy = [self.engines[r] for r in self.healthy_ids()]

        merged: dict[str, dict[str, Any]] = {}
        for entries in await asyncio.gather(*(self._model_entries(e) for e in healthy)):
            for entry in entries or ():
                mid = entry.get("id")
                if isinstance(mid, str):
                    merged.setdefault(mid, entry)
        for entry in self.models_payload():
            merged.setdefault(entry["id"], entry)
        return [merged[k] for k in sorted(merged)]
