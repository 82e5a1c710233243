"""The ``/probe`` self-test (contract-and-index.md §9.5): ingest, find and route one synthetic block
in process.

The server's HTTP handler calls ``Prober.run(body)``: a ``ProbeRequestError`` means 400, else
the returned dict is the JSON reply. Probes of one ``(backend, model)`` are serialised (they
share the probe replica's holds); different pairs run concurrently. The probe writes under the
reserved tenant ``inferencecache.io/probe``, which is invisible to lookups, snapshots, gauges,
the cap and quotas, and always cleans up with an in-process ``ALL_CLEARED``.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass, replace
from typing import Any

from inferencecache.index.facade import Index
from inferencecache.index.model import PROBE_TENANT, Event, EventType, Prefix, Reason, Stats, Update
from inferencecache.index.orchestrate import orchestrate
from inferencecache.index.ranking import Rankers, RankSettings
from inferencecache.index.state import IndexState

MAX_PROBE_BODY = 4096
PROBE_BLOCK_TOKENS = 16
_FIELDS = ("backend", "model", "hashScheme", "backendType")
_REQUIRED = ("backend", "model", "hashScheme")

OK = "ok"
FAILED = "failed"
SKIPPED = "skipped"


class ProbeRequestError(ValueError):
    """Invalid probe request body (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    backend: str
    model: str
    hash_scheme: str
    backend_type: str = ""


def decode_probe_body(body: bytes) -> ProbeRequest:
    """Strict JSON object of at most 4 KiB with non-empty ``backend``, ``model``, ``hashScheme``
    and an optional ``backendType``; unknown fields or trailing data are errors."""
    if len(body) > MAX_PROBE_BODY:
        raise ProbeRequestError(f"body exceeds {MAX_PROBE_BODY} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ProbeRequestError(f"invalid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ProbeRequestError("body must be a JSON object")
    folded = {f.lower(): f for f in _FIELDS}
    values: dict[str, Any] = {}
    for k, v in doc.items():
        name = k if k in _FIELDS else folded.get(k.lower())
        if name is None:
            raise ProbeRequestError(f"unknown field {k!r}")
        if v is None:
            values.pop(name, None)
            continue
        if not isinstance(v, str):
            raise ProbeRequestError(f"field {name!r} must be a string")
        values[name] = v
    for name in _REQUIRED:
        if not values.get(name):
            raise ProbeRequestError(f"missing or empty field {name!r}")
    return ProbeRequest(
        backend=values["backend"],
        model=values["model"],
        hash_scheme=values["hashScheme"],
        backend_type=values.get("backendType", ""),
    )


def _lp(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack(">I", len(b)) + b


def probe_hash(hash_scheme: str, model: str, backend: str) -> bytes:
    """``SHA256("inferencecache.io/probe/v1\\n" || lp(scheme) || lp(model) || lp(backend))``."""
    return hashlib.sha256(
        b"inferencecache.io/probe/v1\n" + _lp(hash_scheme) + _lp(model) + _lp(backend)
    ).digest()


def probe_replica(backend: str) -> str:
    return f"__probe-{backend}"


class Prober:
    """Runs probes against one ``Index``."""

    def __init__(self, index: Index) -> None:
        self._index = index
        self._names = index.run_locked(lambda st: st.replicas.names)
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], tuple[threading.Lock, int]] = {}

    def run(self, body: bytes) -> dict[str, object]:
        """Decode and run one probe; raises ``ProbeRequestError`` for a bad body."""
        return self.run_request(decode_probe_body(body))

    def run_request(self, req: ProbeRequest) -> dict[str, object]:
        key = (req.backend, req.model)
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                return self._probe(req)
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users <= 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def _probe(self, req: ProbeRequest) -> dict[str, object]:
        index = self._index
        replica = probe_replica(req.backend)
        h = probe_hash(req.hash_scheme, req.model, req.backend)
        errors: list[dict[str, str]] = []
        stages = {"ingest": SKIPPED, "routing": SKIPPED, "t2": SKIPPED}
        update = Update(
            replica_id=replica,
            model_id=req.model,
            tenant_id=PROBE_TENANT,
            hash_scheme=req.hash_scheme,
            prefixes=[Prefix(block_hashes=[h], block_token_counts=[PROBE_BLOCK_TOKENS], tier=1)],
            stats=Stats(hit_rate=1.0),
        )
        try:
            try:
                index.apply_update(update, allow_probe=True)
                if self._found(req, replica, h):
                    stages["ingest"] = OK
                else:
                    stages["ingest"] = FAILED
                    errors.append(
                        {"stage": "ingest", "message": "probe block not found after ingest"}
                    )
            except Exception as e:  # a failing stage is reported, never raised
                stages["ingest"] = FAILED
                errors.append({"stage": "ingest", "message": f"{type(e).__name__}: {e}"})
            if stages["ingest"] == OK:
                try:
                    if self._routed(req, replica, h):
                        stages["routing"] = OK
                    else:
                        stages["routing"] = FAILED
                        errors.append(
                            {
                                "stage": "routing",
                                "message": f"lookup did not return PREFIX_MATCH with {replica}",
                            }
                        )
                except Exception as e:
                    stages["routing"] = FAILED
                    errors.append({"stage": "routing", "message": f"{type(e).__name__}: {e}"})
        finally:
            index.apply_event(
                Event(
                    type=EventType.ALL_CLEARED,
                    replica_id=replica,
                    model_id=req.model,
                    tenant_id=PROBE_TENANT,
                ),
                allow_probe=True,
            )
        reply: dict[str, object] = {"backend": req.backend, **stages}
        if errors:
            reply["errors"] = errors
        return reply

    def _found(self, req: ProbeRequest, replica: str, h: bytes) -> bool:
        now_us = self._index.clock.now_us()

        def found(st: IndexState) -> bool:
            rid = st.replicas.get(replica)
            part = st.parts.get((PROBE_TENANT, req.model, req.hash_scheme, ""))
            if rid is None or part is None:
                return False
            fresh_after = now_us - st.policies.get(PROBE_TENANT).ttl_us
            return any(r == rid for r, *_ in part.store.holders(h, fresh_after))

        return self._index.run_locked(found)

    def _routed(self, req: ProbeRequest, replica: str, h: bytes) -> bool:
        index = self._index
        # the probe tenant's TTL; no G1 floor and no LFU credit for the synthetic block
        ranking = RankSettings.of(index.settings, index.policy(PROBE_TENANT))
        rankers = Rankers(self._names, replace(ranking, min_matched=0, credit=False))
        key = (PROBE_TENANT, req.model, req.hash_scheme, "")
        strategy, rows, _, _ = index.run_locked(
            orchestrate, rankers, index.settings, key, [h], [PROBE_BLOCK_TOKENS], h,
            index.clock.now_us(), 0,
        )  # fmt: skip
        return strategy == Reason.PREFIX_MATCH and any(r.replica_id == replica for r in rows)
