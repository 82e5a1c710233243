"""The subscriber's Prometheus metrics (engine-events-and-subscriber.md §10), on a dedicated
registry.

Label children on hot paths are bound once here; callers hold the child objects.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from inferencecache.kvevents.decode import REJECT_REASONS
from inferencecache.metrics import FallbackCollector
from inferencecache.supervise import Drops, drop_counter

PREFIX = "inferencecache_subscriber_"

IGNORE_REASONS = ("group", "block_size", "no_tokens", "bigram", "token_mismatch")
OPTIONAL_FIELDS = ("medium", "lora_name", "group_idx", "kv_cache_spec_kind")
EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown")
FRAME_REASONS = ("frame_count", "seq_length")
RPCS = ("ReportCacheState", "PublishEvent", "stats")
RESTART_CAUSES = ("seq_regression", "disconnect")
STATS_RESULTS = ("ok", "scrape_failed", "send_failed", "rejected")
POLL_RESULTS = ("ok", "failed")
TIERS = ("T1", "T2")


class SubscriberMetrics:
    """Every counter and gauge of one subscriber process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        r.register(FallbackCollector(PREFIX + "native_fallbacks"))

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        self.batches_received = counter("batches_received", "Engine event batches received.")
        rejected = counter("batches_rejected", "Batches rejected whole, by reason.", ("reason",))
        self.batches_rejected = {k: rejected.labels(k) for k in REJECT_REASONS}
        frames = counter("frames_malformed", "ZeroMQ messages of the wrong shape.", ("reason",))
        self.frames_malformed = {k: frames.labels(k) for k in FRAME_REASONS}
        events = counter("events", "Decoded events, by type.", ("type",))
        self.events = {k: events.labels(k) for k in EVENT_TYPES}
        ignored = counter("events_ignored", "Events ignored, by reason.", ("reason",))
        self.events_ignored = {k: ignored.labels(k) for k in IGNORE_REASONS}
        fields = counter("fields_ignored", "Optional event fields of the wrong type.", ("field",))
        self.fields_ignored = {k: fields.labels(k) for k in OPTIONAL_FIELDS}
        self.seq_gaps = counter("seq_gaps", "Sequence gaps detected.")
        self.seq_gap_batches = counter("seq_gap_batches", "Batches missing at gap detection.")
        self.missed_batches = counter("missed_batches", "Batches lost for good (not replayed).")
        self.replays = counter("replays", "Replay requests sent to the engine.")
        self.replayed_batches = counter("replayed_batches", "Batches recovered by replay.")
        restarts = counter("engine_restarts", "Engine restarts detected.", ("cause",))
        self.engine_restarts = {k: restarts.labels(k) for k in RESTART_CAUSES}
        reported = counter("prefixes_reported", "Prefix entries delivered, by tier.", ("tier",))
        self.prefixes_reported = {k: reported.labels(k) for k in TIERS}
        self.evictions = counter("evictions", "PREFIX_EVICTED events delivered.")
        self.all_cleared = counter("all_cleared", "ALL_CLEARED events delivered.")
        failures = counter("rpc_failures", "Failed RPCs, by RPC.", ("rpc",))
        self.rpc_failures = {k: failures.labels(k) for k in RPCS}
        self.adds_not_sent = counter(
            "adds_not_sent", "Prefix entries not delivered (server down, backoff, full queue)."
        )
        self.events_not_sent = counter(
            "events_not_sent", "Eviction/clear events not delivered (covered by the next resync)."
        )
        self.lora_drops = counter("lora_drops", "BlockStored dropped for an unresolvable adapter.")
        self.resyncs = counter("resyncs", "Full resident-state resyncs sent to the server.")
        self.resync_entries = counter("resync_entries", "Prefix entries re-sent by resyncs.")
        ticks = counter("stats_ticks", "Stats ticks, by result.", ("result",))
        self.stats_ticks = {k: ticks.labels(k) for k in STATS_RESULTS}
        self.refresh_entries = counter(
            "refresh_entries", "Resident blocks re-reported by the refresher (--refresh-interval)."
        )
        self.engine_alive = Gauge(
            PREFIX + "engine_alive",
            "1 while the engine counts as alive (the refresher runs), else 0.",
            registry=r,
        )
        polls = counter("adapter_polls", "Engine adapter listings (/v1/models), by result.",
                        ("result",))
        self.adapter_polls = {k: polls.labels(k) for k in POLL_RESULTS}
        self.adapters_forgotten = counter(
            "adapters_forgotten", "Adapter partitions dropped because the engine unloaded them."
        )
        self.adapter_blocks_forgotten = counter(
            "adapter_blocks_forgotten", "Blocks evicted from the index with their unloaded adapter."
        )
        # inputs whose handling raised unexpectedly (supervise.Drops): {loop, reason}
        self.drops = Drops(drop_counter(PREFIX, r), logging.getLogger("inferencecache.subscriber"))
        self.tracked_blocks = Gauge(
            PREFIX + "tracked_blocks", "Engine blocks in the reverse map.", registry=r
        )
        self._last_event = 0.0
        age = Gauge(
            PREFIX + "last_event_age_seconds",
            "Seconds since the last engine batch (-1 before the first).",
            registry=r,
        )
        age.set_function(self._event_age)

    def _event_age(self) -> float:
        return -1.0 if not self._last_event else time.monotonic() - self._last_event

    def mark_event(self) -> None:
        """Record that an engine batch arrived now."""
        self._last_event = time.monotonic()

    def last_event_at(self) -> float | None:
        """``time.monotonic()`` of the last engine message, ``None`` before the first."""
        return self._last_event or None
