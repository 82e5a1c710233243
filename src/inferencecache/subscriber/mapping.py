"""Engine blocks → content fingerprints (engine-events-and-subscriber.md §3.4, §5, §6).

The mapper owns the per-replica state: ``(group, engine hash) → (prefix, tokens, adapter,
media)``. It turns each decoded event into contract actions on an :class:`Outbox` (adds, T2
re-reports, evictions, clears) and never does I/O itself, so it is tested without sockets.
Engine hashes are only used to find a block's parent and to translate removals; the routing key
is always the token fingerprint, chained from the parent's prefix hash.
"""

from __future__ import annotations

import logging
from typing import Final, Protocol

from inferencecache.fingerprint import chain_packed, split_packed
from inferencecache.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch
from inferencecache.subscriber.lora import LoraResolver
from inferencecache.subscriber.messages import Entry, timestamp_us
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.tiers import GPU, T2, best_tier, normalize_medium, only

log = logging.getLogger("inferencecache.subscriber")

# Groups whose blocks give a prefix signal; every other kv_cache_spec_kind is ignored.
FULL_ATTENTION_KINDS: Final = frozenset(("full_attention", "mla_attention", "sink_full_attention"))
_INT32_MAX: Final = (1 << 31) - 1

# (prefix_hash, cumulative tokens, adapter, media). Immutable: a resync snapshot is a list copy.
Block = tuple[bytes, int, str, frozenset[str]]


class Outbox(Protocol):
    """Where the mapper's actions go (the forwarder, or a recorder in tests)."""

    def add_many(self, entries: list[Entry], ts_us: int) -> None:
        """Pending adds, debounced by the window."""

    def flush(self) -> None:
        """Send pending adds now (before a removal)."""

    def report(self, entries: list[Entry], ts_us: int) -> None:
        """One separate update (T2 re-reports), after the pending adds."""

    def evict(self, prefix: bytes, adapter: str, ts_us: int) -> None:
        """``PREFIX_EVICTED`` for one block."""

    def clear(self, ts_us: int) -> None:
        """Discard pending adds and send ``ALL_CLEARED``."""


class BlockMapper:
    """Applies decoded batches to the reverse map and emits contract actions."""

    def __init__(
        self,
        *,
        block_size: int,
        resolver: LoraResolver,
        outbox: Outbox,
        metrics: SubscriberMetrics,
        ignore_block_removed: bool = False,
    ) -> None:
        self.block_size = block_size
        self.resolver = resolver
        self.outbox = outbox
        self.metrics = metrics
        self.ignore_block_removed = ignore_block_removed
        self._groups: dict[int, dict[bytes, Block]] = {}
        self._bigram_warned = False
        m = metrics
        self._ignored_group = m.events_ignored["group"]
        self._ignored_size = m.events_ignored["block_size"]
        self._ignored_no_tokens = m.events_ignored["no_tokens"]
        self._ignored_bigram = m.events_ignored["bigram"]
        self._ignored_mismatch = m.events_ignored["token_mismatch"]

    # ---- state ------------------------------------------------------------------------------

    def block_count(self) -> int:
        """Engine blocks currently tracked (every group)."""
        return sum(len(g) for g in self._groups.values())

    def lookup(self, engine_hash: bytes, group: int = 0) -> Block | None:
        """The state of one engine block (tests, debugging)."""
        return self._groups.get(group, {}).get(engine_hash)

    def snapshot(self) -> list[list[Block]]:
        """The resident blocks now, per group (cheap C-level list copies of immutable tuples)."""
        return [list(g.values()) for g in self._groups.values()]

    def engine_restarted(self) -> None:
        """The engine went away (restart or disconnect): forget it and clear the server."""
        self._groups.clear()
        self.metrics.tracked_blocks.set(0)
        self.outbox.clear(0)

    # ---- events -----------------------------------------------------------------------------

    def apply(self, batch: DecodedBatch) -> None:
        """Apply every event of one accepted batch, in order."""
        ts_us = timestamp_us(batch.ts)
        m = self.metrics
        stored = removed = cleared = 0
        for ev in batch.events:
            if type(ev) is BlockStored:
                stored += 1
                self._stored(ev, ts_us)
            elif type(ev) is BlockRemoved:
                removed += 1
                self._removed(ev, ts_us)
            elif type(ev) is AllBlocksCleared:
                cleared += 1
                self._groups.clear()
                self.outbox.clear(ts_us)
        if stored:
            m.events["BlockStored"].inc(stored)
        if removed:
            m.events["BlockRemoved"].inc(removed)
        if cleared:
            m.events["AllBlocksCleared"].inc(cleared)
        if batch.unknown_events:
            m.events["unknown"].inc(batch.unknown_events)
        for name in batch.ignored_fields:
            m.fields_ignored[name].inc()
        m.tracked_blocks.set(self.block_count())

    def _stored(self, ev: BlockStored, ts_us: int) -> None:
        if ev.bigram:
            self._ignored_bigram.inc()
            if not self._bigram_warned:
                self._bigram_warned = True
                log.warning(
                    "ignoring BlockStored with bigram token keys (SGLang EAGLE); such pages "
                    "never match a token fingerprint; further ones are not logged",
                    extra={"block_hashes": len(ev.block_hashes)},
                )
            return
        medium = normalize_medium(ev.medium)
        group = ev.group_idx or 0
        tokens = ev.token_ids
        if not tokens and medium != GPU:
            # Connector placeholder: a media-only announcement for blocks we already know.
            blocks = self._groups.get(group)
            if blocks:
                added = only(medium)
                for h in ev.block_hashes:
                    b = blocks.get(h)
                    if b is not None and medium not in b[3]:
                        blocks[h] = (b[0], b[1], b[2], b[3] | added)
            self._ignored_no_tokens.inc()
            return
        adapter = self.resolver.resolve(ev.lora_id, ev.lora_name)
        if adapter is None:
            self.metrics.lora_drops.inc()
            return
        kind = ev.kv_cache_spec_kind
        if kind is not None and kind not in FULL_ATTENTION_KINDS:
            self._ignored_group.inc()
            return
        bs = ev.block_size
        if bs != self.block_size:
            self._ignored_size.inc()
            return
        hashes = ev.block_hashes
        n = len(tokens) // bs
        if n != len(hashes):
            if hashes:
                self._ignored_mismatch.inc()
                log.warning(
                    "BlockStored produced no index entries (missing or mismatched token_ids)",
                    extra={"block_hashes": len(hashes), "token_ids": len(tokens), "block_size": bs},
                )
            return
        if not n:
            return
        blocks = self._groups.get(group)
        if blocks is None:
            blocks = self._groups[group] = {}
        parent: int | None = None
        start = 0
        if ev.parent_block_hash is not None:
            pb_ = blocks.get(ev.parent_block_hash)
            if pb_ is not None:
                parent = int.from_bytes(pb_[0], "big")
                start = pb_[1]
        prefixes = split_packed(chain_packed(tokens, bs, parent))
        fresh = only(medium)
        fresh_tier = best_tier(fresh)
        limit = _INT32_MAX
        entries: list[Entry] = []
        append = entries.append
        get = blocks.get
        count = start
        for h, prefix in zip(hashes, prefixes, strict=True):
            count += bs
            tokens_i = count if count <= limit else limit
            old = get(h)
            if old is None:
                blocks[h] = (prefix, tokens_i, adapter, fresh)
                append((prefix, tokens_i, adapter, fresh_tier))
                continue
            media = old[3]
            if medium not in media:
                media = media | fresh
            blocks[h] = (prefix, tokens_i, adapter, media)
            append((prefix, tokens_i, adapter, best_tier(media)))
        self.outbox.add_many(entries, ts_us)

    def _removed(self, ev: BlockRemoved, ts_us: int) -> None:
        blocks = self._groups.get(ev.group_idx or 0)
        if not blocks:
            return
        medium = normalize_medium(ev.medium)
        gone = only(medium)
        downgrades: list[Entry] = []
        evictions: list[tuple[bytes, str]] = []
        for h in ev.block_hashes:
            b = blocks.get(h)
            if b is None or medium not in b[3]:
                continue
            media = b[3] - gone
            if not media:
                del blocks[h]
                if self.ignore_block_removed and medium == GPU:
                    downgrades.append((b[0], b[1], b[2], T2))
                else:
                    evictions.append((b[0], b[2]))
                continue
            blocks[h] = (b[0], b[1], b[2], media)
            tier = best_tier(media)
            if tier != best_tier(b[3]):
                downgrades.append((b[0], b[1], b[2], tier))
        if not downgrades and not evictions:
            return
        out = self.outbox
        out.flush()
        if downgrades:
            out.report(downgrades, ts_us)
        for prefix, adapter in evictions:
            out.evict(prefix, adapter, ts_us)
