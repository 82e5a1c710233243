"""The live page (contract-and-index.md §13.6): ``GET /live`` (static HTML, ``live.html``),
``GET /live/state`` and ``POST /live/lookup`` (JSON, under the admin rule).

Why polling a JSON path rather than SSE: a bearer token cannot be sent by ``EventSource``, and
the admin rule must hold for the page's data; ``fetch`` can send it. The state is fed by one
change-feed observer (``index/changes.py``) that exists only while a page polled within
``IDLE_S`` seconds, so an unwatched server builds no change at all.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from importlib import resources
from typing import Any, Protocol

import msgspec

from inferencecache import fingerprint
from inferencecache.index.changes import Closed, Observer, Overflowed, Replaced
from inferencecache.index.facade import Index
from inferencecache.index.model import PROBE_TENANT, EventType, LookupRequest, LookupResult
from inferencecache.index.state import IndexState
from inferencecache.server.lookup_json import encode_response
from inferencecache.server.lookup_path import LookupPath

IDLE_S = 30.0
RECENT = 40  # latest events shown
RATE_WINDOW_S = 10.0
MAX_BACKLOG = 200_000
MAX_LOOKUP_BODY = 1024 * 1024
_TYPE_NAMES = {int(t): t.name for t in EventType}


def page_html() -> bytes:
    return resources.files("inferencecache.server").joinpath("live.html").read_bytes()


class LiveBackend(Protocol):
    index: Index


class _LookupBody(msgspec.Struct, forbid_unknown_fields=True):
    tenant: str = "default"
    model: str = ""
    adapter: str = ""
    hashScheme: str = "vllm"  # the page's JSON names
    text: str = ""
    tokenIds: list[int] = []  # msgspec copies defaults


class LookupInputError(ValueError):
    """A ``/live/lookup`` body the page should not have sent (answered 400)."""


class LiveView:
    """What the page shows; every method is blocking (the HTTP layer runs it off its loop)."""

    def __init__(
        self, index: Index, lookup: LookupPath, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._index = index
        self._lookup = lookup
        self._clock = clock
        self._lock = threading.Lock()
        self._obs: Observer | None = None
        self._last_poll = 0.0
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self._window: deque[tuple[float, int]] = deque()
        self._totals: dict[str, int] = {}
        self._resyncs = 0

    # -- the change feed ------------------------------------------------------------------------

    def _drain(self, now: float) -> None:
        """Take every change the observer holds (opening it on the first poll)."""
        if self._obs is None:
            self._obs = self._index.observe(MAX_BACKLOG)
        n = 0
        while True:
            try:
                batch = self._obs.next_batch(0)
            except (Overflowed, Replaced, Closed):
                self._resyncs += 1
                self._obs = self._index.observe(MAX_BACKLOG)
                break
            if not batch:
                break
            for c in batch:
                if c.tenant == PROBE_TENANT:
                    continue
                name = _TYPE_NAMES.get(c.type, str(c.type))
                keys = list(c.each_hash()) if c.hashes else []
                count = max(1, len(keys))
                n += count
                self._totals[name] = self._totals.get(name, 0) + count
                self._recent.append({
                    "type": name, "tenant": c.tenant, "model": c.model, "adapter": c.adapter,
                    "replica": c.replica, "hashes": [k.hex() for k in keys[:4]],
                    "count": count, "timestampUs": c.timestamp_us,
                })  # fmt: skip
        self._window.append((now, n))
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()

    def expire_if_idle(self) -> None:
        """Close the observer when no page polled for ``IDLE_S`` (called periodically)."""
        with self._lock:
            if self._obs is not None and self._clock() - self._last_poll > IDLE_S:
                self._obs.close()
                self._obs = None
                self._window.clear()

    def close(self) -> None:
        with self._lock:
            if self._obs is not None:
                self._obs.close()
                self._obs = None

    # -- /live/state ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        now = self._clock()
        with self._lock:
            self._last_poll = now
            self._drain(now)
            # changes drained since the window's first poll, over at least one second
            span = max(1.0, now - self._window[0][0])
            rate = sum(n for _, n in list(self._window)[1:]) / span
            recent = list(reversed(self._recent))
            totals = dict(self._totals)
            resyncs = self._resyncs
        doc = self._index.run_locked(_index_view, self._index.clock.now_us())
        doc["events"] = {"perSecond": round(rate, 2), "totals": totals, "recent": recent,
                         "resyncs": resyncs}  # fmt: skip
        return doc

    # -- /live/lookup ---------------------------------------------------------------------------

    def lookup(self, body: bytes) -> dict[str, Any]:
        """One LookupRoute through the server's lookup path, plus the request's blocks and how
        many of them each ranked replica matched."""
        try:
            b = msgspec.json.decode(body, type=_LookupBody)
        except msgspec.DecodeError as e:
            raise LookupInputError(f"malformed lookup: {e}") from None
        if bool(b.text) == bool(b.tokenIds):
            raise LookupInputError("give exactly one of text and tokenIds")
        if any(not 0 <= t < 2**32 for t in b.tokenIds):
            raise LookupInputError("token ids must be in 0..2^32-1")
        req = LookupRequest(tenant_id=b.tenant, model_id=b.model, hash_scheme=b.hashScheme,
                            adapter_id=b.adapter, prompt_text=b.text,
                            token_ids=list(b.tokenIds))  # fmt: skip
        result: LookupResult = self._lookup.answer(req, 5.0, lambda r: r, method="live")
        doc: dict[str, Any] = msgspec.json.decode(encode_response(result))
        tokens = list(b.tokenIds) or list(result.token_ids)
        size = self._index.settings.engine_block_size
        hashes, counts = fingerprint.chain(tokens, size) if tokens else ([], [])
        cum = 0
        blocks = []
        for i, (hh, c) in enumerate(zip(hashes, counts, strict=True)):
            cum += c
            held = [s.replica_id for s in result.replica_scores if s.matched_tokens >= cum]
            blocks.append({"index": i, "hash": hh.hex(), "tokens": cum, "matchedBy": held})
        doc["blocks"] = blocks
        doc["tokenCount"] = len(tokens)
        return doc


def _index_view(st: IndexState, now_us: int) -> dict[str, Any]:
    """Replicas per (tenant, model) with their stats and holds, and partitions with their sizes:
    O(partitions + replicas), never a walk of the holds."""
    names = st.replicas.names
    holds_by: dict[tuple[str, str, str], int] = {}
    for (tenant, model, _scheme), per in st.serving.items():
        if tenant == PROBE_TENANT:
            continue
        for rid, n in per.items():
            key = (tenant, model, names[rid] or "")
            holds_by[key] = holds_by.get(key, 0) + n
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for (tenant, model), stats in st.stats.items():
        if tenant == PROBE_TENANT:
            continue
        for rid, row in stats.items():
            rows[(tenant, model, names[rid] or "")] = {
                "hitRate": round(row.hit_rate, 4), "pressure": round(row.pressure, 4),
                "cacheMemoryBytes": row.cache_memory_bytes,
                "statsAgeS": round(max(0, now_us - row.stats_reported) / 1e6, 1),
            }  # fmt: skip
    replicas = []
    for key in sorted(set(holds_by) | set(rows)):
        doc: dict[str, Any] = {"tenant": key[0], "model": key[1], "replica": key[2],
                               "holds": holds_by.get(key, 0)}  # fmt: skip
        doc.update(rows.get(key, {"hitRate": None, "pressure": None}))
        replicas.append(doc)
    partitions = [
        {"tenant": p.tenant, "model": p.model, "hashScheme": p.scheme, "adapter": p.adapter,
         "keys": p.store.key_count(), "holds": p.store.hold_count()}
        for p in sorted(st.parts.values(), key=lambda p: p.key) if not p.probe
    ]  # fmt: skip
    return {"replicas": replicas, "partitions": partitions,
            "totals": {"holds": st.total_holds - st.reserved_holds,
                       "keys": sum(p["keys"] for p in partitions)}}  # fmt: skip
