"""Applying log entries to an index, the same way on every replica (docs/event-log.md,
"The time rule").

Every time-dependent value comes from the log, never from the applying replica's clock: the
*log clock* is the largest appender timestamp applied so far (so it never goes back when two
appenders' clocks differ a little), and each item of an entry applies at that time: a hold's
``last_seen`` when the update has no ``timestamp_us``, the stats rows' times, the cap and quota
victims that follow. The TTL sweep runs when the log clock has moved ``sweep_interval`` past
the previous sweep, before the entry's items; a quiet log is moved on by tick entries. The
applier's whole state (the log clock and the last sweep time, the policy body in force) goes
into snapshots, so a restored replica continues exactly like one that never stopped.

Items are applied through an ``ItemApplier``: by default ``IndexItems``, the index's own
``apply_batch`` / ``apply_update`` / ``apply_event`` (what the server applies with when there is
no log) after the one decoder of each message; a server with another apply path passes its own,
so the log is applied exactly as direct ingest would be.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from inferencecache.eventlog import codec
from inferencecache.eventlog.metrics import EventLogMetrics
from inferencecache.index.facade import Index
from inferencecache.index.model import PROBE_TENANT
from inferencecache.index.tenant_config import IndexConfig, PolicyError, decode_policy_body
from inferencecache.updatewire.index_input import decode_event_for_apply, decode_update_for_apply

log = logging.getLogger("inferencecache.eventlog")


@dataclass(slots=True)
class LogTime:
    """The applier's state besides the index: what a snapshot must carry."""

    clock_us: int = 0
    last_sweep_us: int = 0
    policy_body: bytes | None = None  # the newest policy entry applied; None: the startup config


class ItemApplier(Protocol):
    """Applies one ``CacheStateUpdate`` / ``CacheEvent`` item (its wire bytes) at the log time;
    returns False when the bytes do not decode (counted and skipped by the caller)."""

    def update(self, payload: bytes, now_us: int) -> bool: ...
    def event(self, payload: bytes, now_us: int) -> bool: ...


class IndexItems:
    """The default ``ItemApplier``: the one decoder of each message, then ``Index.apply_*``."""

    def __init__(self, index: Index) -> None:
        self.index = index

    def update(self, payload: bytes, now_us: int) -> bool:
        update = decode_update_for_apply(payload)
        if update is None:
            return False
        if type(update) is bytes:  # ICB1: the probe tenant's records are skipped inside
            self.index.apply_batch(update, now_us=now_us)
        else:
            self.index.apply_update(update, now_us=now_us)  # type: ignore[arg-type]
        return True

    def event(self, payload: bytes, now_us: int) -> bool:
        event = decode_event_for_apply(payload)
        if event is None:
            return False
        if type(event) is bytes:
            self.index.apply_batch(event, now_us=now_us)
        elif event.tenant_id != PROBE_TENANT:  # type: ignore[union-attr]
            self.index.apply_event(event, now_us=now_us)  # type: ignore[arg-type]
        return True


class Applier:
    """Applies decoded entries to one ``Index``; ``drop`` counts what it skips."""

    def __init__(
        self,
        index: Index,
        metrics: EventLogMetrics,
        *,
        initial_config: IndexConfig | None = None,
        items: ItemApplier | None = None,
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.items: ItemApplier = items if items is not None else IndexItems(index)
        self.time = LogTime()
        self.initial_config = initial_config if initial_config is not None else index.config
        self._sweep_us = max(1, round(index.settings.sweep_interval * 1_000_000))

    def reset(self, time_: LogTime | None = None) -> None:
        """Back to the state of an empty replica (or the given snapshot state), config included."""
        self.time = time_ if time_ is not None else LogTime()
        body = self.time.policy_body
        config = self.initial_config
        if body is not None:
            try:
                config = decode_policy_body(body)
            except PolicyError:
                log.error("snapshot policy body does not decode; keeping the startup policy")
        self.index.replace_config(config)

    def apply(self, entry: codec.Entry) -> None:
        """Apply one entry's items in order. A bad item is counted and skipped."""
        t = self.time
        if entry.timestamp_us > t.clock_us:
            t.clock_us = entry.timestamp_us
        now = t.clock_us
        if now - t.last_sweep_us >= self._sweep_us:
            self.index.sweep(now_us=now)
            t.last_sweep_us = now
        index = self.index
        items = self.items
        applied = self.metrics.applied_items
        for kind, payload in entry.items:
            try:
                if kind == codec.KIND_UPDATE:
                    if not items.update(payload, now):
                        self.metrics.dropped("undecodable_update").inc()
                        continue
                elif kind == codec.KIND_EVENT:
                    if not items.event(payload, now):
                        self.metrics.dropped("undecodable_event").inc()
                        continue
                elif kind == codec.KIND_TICK:
                    pass
                elif kind == codec.KIND_POLICY:
                    try:
                        config = decode_policy_body(payload)
                    except PolicyError:
                        self.metrics.dropped("bad_policy").inc()
                        continue
                    index.replace_config(config)
                    t.policy_body = payload
                    log.info("policy replaced from the event log",
                             extra={"policies": len(config.policies),
                                    "quotas": len(config.quotas)})
                else:
                    self.metrics.dropped("unknown_kind").inc()
                    continue
            except Exception as e:
                # a bug below (the index raised): skip the item, like the server's ingest does;
                # counted in dropped_inputs_total{loop="apply"}, logged rate-limited
                self.metrics.drops.drop("apply", e, kind=codec.KINDS.get(kind, str(kind)))
                continue
            applied(codec.KINDS[kind]).inc()
