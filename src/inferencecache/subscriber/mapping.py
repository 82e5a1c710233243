"""Engine blocks → content fingerprints (engine-events-and-subscriber.md §3.4, §5, §6).

The mapper owns the per-replica state: ``(group, engine hash) → (prefix, tokens, adapter,
media)``. It turns each decoded event into contract actions on an :class:`Outbox` (adds, T2
re-reports, evictions, clears) and never does I/O itself, so it is tested without sockets.
Engine hashes are only used to find a block's parent and to translate removals; the routing key
is always the token fingerprint, chained from the parent's prefix hash.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
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

MAX_RETIRED: Final = 1 << 20
"""Blocks of forgotten adapters kept per group only to resolve later stores' parents."""


@dataclass(slots=True)
class _Partition:
    """Bookkeeping of one non-empty adapter partition (adapter lifecycle, ``adapters.py``)."""

    engine_name: str  # the events' lora_name, else the partition name
    named: bool  # engine_name came from the engine's own events
    since: int  # generation of the batch that stored its first block
    blocks: int  # engine blocks of it in the reverse map


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

    def refresh(self, entries: list[Entry]) -> None:
        """Resident blocks re-reported at "now" (the refresher), in order with everything else."""


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
        # Blocks of adapters the engine no longer serves: gone from the index and from
        # _groups, kept only so a store chained to one (a reloaded adapter hitting its old
        # cached blocks) still gets the right fingerprint instead of a fresh chain.
        self._retired: dict[int, dict[bytes, Block]] = {}
        self._partitions: dict[str, _Partition] = {}
        self.generation = 0  # batches applied: the adapter tracker's clock of the stream
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
        self.generation += 1
        self._forget_all()
        self.metrics.tracked_blocks.set(0)
        self.outbox.clear(0)

    def _forget_all(self) -> None:
        self._groups.clear()
        self._retired.clear()
        self._partitions.clear()

    # ---- refresh (refresh.py) ---------------------------------------------------------------

    def resident(self) -> list[tuple[int, list[bytes]]]:
        """Engine hashes of every resident block, per group (list copies)."""
        return [(g, list(blocks)) for g, blocks in self._groups.items() if blocks]

    def refresh(self, group: int, keys: Sequence[bytes]) -> int:
        """Re-report the blocks of ``keys`` still resident, as they are now; returns how many."""
        blocks = self._groups.get(group)
        if not blocks:
            return 0
        get = blocks.get
        entries: list[Entry] = []
        append = entries.append
        for h in keys:
            b = get(h)
            if b is not None:
                append((b[0], b[1], b[2], best_tier(b[3])))
        if entries:
            self.outbox.refresh(entries)
        return len(entries)

    # ---- adapter lifecycle (adapters.py) ----------------------------------------------------

    def adapter_partitions(self) -> dict[str, tuple[str, bool, int]]:
        """Non-empty adapter partitions: ``{partition: (engine name, named by the engine's
        events, generation of its first block)}``."""
        return {a: (p.engine_name, p.named, p.since) for a, p in self._partitions.items()}

    def forget_adapter(self, partition: str) -> int:
        """The engine no longer serves this adapter: evict its blocks from the index (one
        ``PREFIX_EVICTED`` per block, batched by the forwarder) and forget them. Returns how
        many blocks were dropped. Later stores of the partition start fresh."""
        if not partition:
            return 0
        self._partitions.pop(partition, None)
        gone: list[bytes] = []
        for group, blocks in self._groups.items():
            keys = [h for h, b in blocks.items() if b[2] == partition]
            if not keys:
                continue
            retired = self._retired.setdefault(group, {})
            for h in keys:
                b = blocks.pop(h)
                retired[h] = b
                gone.append(b[0])
            while len(retired) > MAX_RETIRED:
                del retired[next(iter(retired))]
        if gone:
            out = self.outbox
            out.flush()
            for prefix in gone:
                out.evict(prefix, partition, 0)
            self.metrics.tracked_blocks.set(self.block_count())
        return len(gone)

    # ---- events -----------------------------------------------------------------------------

    def apply(self, batch: DecodedBatch) -> None:
        """Apply every event of one accepted batch, in order."""
        ts_us = timestamp_us(batch.ts)
        m = self.metrics
        self.generation += 1
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
                self._forget_all()
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
        retired = self._retired.get(group) if self._retired else None
        parent: int | None = None
        start = 0
        if ev.parent_block_hash is not None:
            pb_ = blocks.get(ev.parent_block_hash)
            if pb_ is None and retired:
                pb_ = retired.get(ev.parent_block_hash)
            if pb_ is not None:
                parent = int.from_bytes(pb_[0], "big")
                start = pb_[1]
        if retired:
            for h in hashes:
                retired.pop(h, None)  # live again
        prefixes = split_packed(chain_packed(tokens, bs, parent))
        fresh = only(medium)
        fresh_tier = best_tier(fresh)
        limit = _INT32_MAX
        entries: list[Entry] = []
        append = entries.append
        get = blocks.get
        count = start
        before = len(blocks)
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
        if adapter:
            self._note_adapter(adapter, ev.lora_name, len(blocks) - before)
        self.outbox.add_many(entries, ts_us)

    def _note_adapter(self, adapter: str, lora_name: str | None, new_blocks: int) -> None:
        p = self._partitions.get(adapter)
        if p is None:
            if not new_blocks:
                return
            named = bool(lora_name)
            p = self._partitions[adapter] = _Partition(
                lora_name if lora_name else adapter, named, self.generation, 0)
        elif lora_name and (not p.named or p.engine_name != lora_name):
            p.engine_name, p.named = lora_name, True
        p.blocks += new_blocks

    def _dropped_from(self, adapter: str) -> None:
        p = self._partitions.get(adapter)
        if p is not None:
            p.blocks -= 1
            if p.blocks <= 0:
                del self._partitions[adapter]

    def _removed(self, ev: BlockRemoved, ts_us: int) -> None:
        group = ev.group_idx or 0
        if self._retired:
            retired = self._retired.get(group)
            if retired:
                for h in ev.block_hashes:
                    retired.pop(h, None)
        blocks = self._groups.get(group)
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
                if b[2]:
                    self._dropped_from(b[2])
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
