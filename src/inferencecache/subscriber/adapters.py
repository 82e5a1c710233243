"""LoRA adapter lifecycle: forget an adapter's blocks once the engine no longer serves it.

Engines publish nothing when an adapter is unloaded (vLLM 0.32's ``/v1/unload_lora_adapter``
emits no KV event), so its partition would keep pointing at the replica; with the refresher
(``refresh.py``) it would even stay fresh as long as the engine keeps the blocks cached. The
engine's OpenAI ``GET /v1/models`` lists every loaded adapter as a model with a ``parent`` (vLLM,
and SGLang with ``--enable-lora``), with its path as ``root``. The subscriber polls it
(``--engine-models-url``, every ``--adapter-poll-interval``) and :class:`AdapterTracker` drops
the replica's holds in a partition whose adapter is gone (or was reloaded from another path:
new weights, new engine hashes), through batched ``PREFIX_EVICTED`` events with its
``adapter_id``; the mapper forgets the blocks, so a reloaded adapter starts fresh.

Rules, so that a poll can only drop what is really gone:

* A listing counts only if it names ``--model-id`` as a base model (or as an adapter's parent):
  a URL pointing at another engine is a failed poll, never a reason to drop anything.
* A partition's engine-side name is the events' ``lora_name`` when they carry one; else (an
  engine that sends only ``lora_id``, named by ``--lora-adapter-names``) the partition name,
  which is then trusted only after a listing has shown it: a table whose names differ from the
  engine's never drops anything.
* A partition whose first block was applied after the poll request was sent is kept: the
  listing may predate the adapter's load.

:class:`AdapterTracker` does no I/O (the simulator runs it in simulated time);
:class:`AdapterPoller` is the subscriber's HTTP task around it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import aiohttp

from inferencecache.subscriber.metrics import SubscriberMetrics

log = logging.getLogger("inferencecache.subscriber")

POLL_TIMEOUT: Final = 5.0
MAX_BODY: Final = 4 * 1024 * 1024  # a models listing is a few KB; refuse anything absurd
WARN_EVERY: Final = 60.0  # seconds between two warnings about failing polls


class ModelsError(Exception):
    """The engine's answer is not a models listing for this subscriber's model."""


def parse_models(body: Any, model_id: str) -> dict[str, str]:
    """The adapters a ``/v1/models`` answer lists, ``{id: root}`` (``root`` may be ``""``).

    ``body`` is the decoded JSON (``{"data": [{"id", "root", "parent"}, ...]}``). Raises
    :class:`ModelsError` unless ``model_id`` is served: as a base model (no ``parent``) or as
    the ``parent`` of an adapter."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ModelsError("no 'data' list in the answer")
    adapters: dict[str, str] = {}
    served = False
    for card in data:
        if not isinstance(card, dict):
            continue
        mid = card.get("id")
        if not isinstance(mid, str) or not mid:
            continue
        parent = card.get("parent")
        if parent is None or parent == "":
            served = served or mid == model_id
            continue
        if not isinstance(parent, str):
            continue
        served = served or parent == model_id
        root = card.get("root")
        adapters[mid] = root if isinstance(root, str) else ""
    if not served:
        raise ModelsError(f"the listing does not serve --model-id {model_id!r}")
    return adapters


class AdapterSource(Protocol):
    """What the tracker reads and acts on: the mapper (``BlockMapper``)."""

    @property
    def generation(self) -> int:
        """Batches applied so far (a clock of the event stream)."""

    def adapter_partitions(self) -> dict[str, tuple[str, bool, int]]:
        """Non-empty adapter partitions: ``{partition: (engine name, named by the engine's
        events, generation of its first block)}``."""

    def forget_adapter(self, partition: str) -> int:
        """Evict the partition's blocks from the index and forget them; returns how many."""


class AdapterTracker:
    """Compares successive listings of the engine's adapters with the mapper's partitions."""

    def __init__(self, source: AdapterSource, metrics: SubscriberMetrics | None = None) -> None:
        self.source = source
        self.metrics = metrics
        self._roots: dict[str, str] = {}  # the last listing
        self._listed_ever: set[str] = set()

    def begin(self) -> int:
        """Call right before asking the engine; pass the result to :meth:`observe`."""
        return self.source.generation

    def observe(self, asked_at: int, listed: Mapping[str, str]) -> list[str]:
        """Apply one listing (``{adapter: root}``); returns the partitions dropped."""
        previous = self._roots
        reloaded = {n for n, root in listed.items() if n in previous and previous[n] != root}
        dropped: list[str] = []
        for part, (name, named, since) in self.source.adapter_partitions().items():
            if since > asked_at:
                continue  # stored after the listing was asked for: it may predate the load
            # listed: gone only if reloaded from another path; unlisted: gone if the name is
            # surely the engine's (from its events, or listed before)
            gone = name in reloaded if name in listed else named or name in self._listed_ever
            if not gone:
                continue
            n = self.source.forget_adapter(part)
            dropped.append(part)
            if self.metrics is not None:
                self.metrics.adapters_forgotten.inc()
                self.metrics.adapter_blocks_forgotten.inc(n)
            log.info(
                "LoRA adapter no longer served by the engine; dropped its blocks",
                extra={"adapter_id": part, "engine_name": name, "blocks": n,
                       "reloaded": name in reloaded},
            )
        self._roots = dict(listed)
        self._listed_ever.update(listed)
        return dropped


class AdapterPoller:
    """``GET --engine-models-url`` every ``interval`` and feed the tracker (until cancelled)."""

    def __init__(
        self,
        tracker: AdapterTracker,
        metrics: SubscriberMetrics,
        *,
        url: str,
        model_id: str,
        interval: float,
        on_answer: Callable[[float], None] | None = None,
        timeout: float = POLL_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tracker = tracker
        self.metrics = metrics
        self.url = url
        self.model_id = model_id
        self.interval = interval
        self.on_answer = on_answer
        self.timeout = timeout
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._warned_at: float | None = None

    async def fetch(self) -> dict[str, str]:
        """One listing; :class:`ModelsError` for anything but a usable answer."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout))
        try:
            async with self._session.get(self.url) as resp:
                if resp.status != 200:
                    raise ModelsError(f"GET {self.url}: HTTP {resp.status}")
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.content.iter_chunked(65536):
                    size += len(chunk)
                    if size > MAX_BODY:
                        raise ModelsError(f"GET {self.url}: answer larger than {MAX_BODY} bytes")
                    chunks.append(chunk)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ModelsError(f"GET {self.url}: {type(e).__name__}: {e}") from None
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelsError(f"GET {self.url}: not JSON: {e}") from None
        listed = parse_models(body, self.model_id)
        if self.on_answer is not None:
            self.on_answer(self.clock())  # our engine answered: it is alive
        return listed

    async def poll(self) -> list[str] | None:
        """One poll; the partitions dropped, or ``None`` when the poll failed (nothing dropped)."""
        asked_at = self.tracker.begin()
        try:
            listed = await self.fetch()
        except ModelsError as e:
            self.metrics.adapter_polls["failed"].inc()
            now = self.clock()
            if self._warned_at is None or now - self._warned_at >= WARN_EVERY:
                self._warned_at = now
                log.warning("engine adapter listing failed; keeping every adapter's blocks",
                            extra={"err": str(e), "url": self.url})
            return None
        self.metrics.adapter_polls["ok"].inc()
        self._warned_at = None
        return self.tracker.observe(asked_at, listed)

    async def run(self) -> None:
        """Poll every interval until cancelled (the first poll right away)."""
        log.info("adapter lifecycle polling starting",
                 extra={"url": self.url, "interval_s": self.interval})
        try:
            while True:
                await self.poll()
                await asyncio.sleep(self.interval)
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the HTTP session (``run`` does it when cancelled)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
