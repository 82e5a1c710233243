"""The index's binary batch of updates (``ICB1``): what ingest messages become before the index
applies them, in one compiled call per batch (``_blockmap.Applier``), with this module as the
reference reader and applier.

Why a binary form: a ``ReportCacheState`` update of a subscriber is thousands of 8-byte hashes
and int32 counts; as Python objects they cost ~1 µs each to build and read. The server's wire
parsers (``updatewire.pack_update`` / ``pack_event``, C) write each message as one batch, and
the applier writes it into the partitions' stores without a Python object per block. The same
bytes are what an ingest log carries (a Redis Streams entry, issue 10): every replica applies
the log's entries in order through ``Index.apply_batch``, so a log entry needs no other decoder.

Layout (version 1, little-endian; ``encode`` writes it, ``records`` reads it)::

    batch   = "ICB1" | i64 appended_us | record*
    record  = u8 kind | 3 zero bytes | u32 body length | body
    route   = 5 × (u32 length | UTF-8): tenant, model, hash scheme, adapter, replica
    STORE   (1) = route | i64 timestamp_us | i32 tier | u32 n | n × 8-byte hash | n × i32 tokens
    REMOVE  (2) = route | i64 timestamp_us | u32 n | n × 8-byte hash
    CLEAR   (3) = route | i64 timestamp_us
    STATS   (4) = route | i64 timestamp_us | i64 cache_memory_bytes | f32 hit_rate |
                  f32 pressure | i64 t2_hit_tokens | i64 t2_query_tokens

Meaning, record by record and in order, exactly as the contract's messages
(contract-and-index.md §4): STORE is one ``CacheStateUpdate`` whose entries are legacy
``PrefixEntry`` messages (hash i with ``token_count`` tokens i, wire ``tier``, the route's
adapter); REMOVE is a ``PREFIX_EVICTED`` event of its hashes (scheme unused; adapter "" = every
adapter); CLEAR is ``ALL_CLEARED``; STATS is a ``CacheStateUpdate`` carrying only ``stats``. A
record timestamp of 0 means ``appended_us`` (the appender's clock, e.g. a log's), and
``appended_us`` 0 means the applier's clock. A new version changes the magic; new record kinds
may be added within a version (an applier hands a kind it does not know to this module, which
rejects it).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from inferencecache.index import apply, bounds, eviction
from inferencecache.index.changes import PREFIX_ADDED, Change
from inferencecache.index.model import (
    PROBE_TENANT,
    Event,
    EventType,
    LegacyRun,
    PackedUpdate,
    Stats,
)
from inferencecache.index.state import IndexState

MAGIC: Final = b"ICB1"
HEADER: Final = 12
STORE: Final = 1
REMOVE: Final = 2
CLEAR: Final = 3
STATS: Final = 4

_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<4sq")
_REC = struct.Struct("<B3xI")
_STORE = struct.Struct("<qiI")
_REMOVE = struct.Struct("<qI")
_TS = struct.Struct("<q")
_STATS = struct.Struct("<qqffqq")


class BatchError(ValueError):
    """Bytes that are not a well-formed ICB1 batch."""


@dataclass(frozen=True, slots=True)
class Route:
    tenant: str
    model: str
    scheme: str = ""
    adapter: str = ""
    replica: str = ""


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded record: ``hashes`` packed 8-byte keys, ``tokens`` int32 counts (STORE),
    ``stats`` the five STATS values."""

    kind: int
    route: Route
    timestamp_us: int = 0
    tier: int = 0
    hashes: bytes = b""
    tokens: Sequence[int] = ()
    stats: Stats | None = None


# -- writing (the reference encoder: tests, and the server without the compiled packers) ----


def _route(r: Route) -> bytes:
    out = bytearray()
    for s in (r.tenant, r.model, r.scheme, r.adapter, r.replica):
        raw = s.encode()
        out += _U32.pack(len(raw)) + raw
    return bytes(out)


def encode_record(rec: Record) -> bytes:
    body = _route(rec.route)
    if rec.kind == STORE:
        n = len(rec.hashes) // 8
        if len(rec.hashes) != 8 * n or len(rec.tokens) != n:
            raise BatchError("STORE: 8 hash bytes and one token count per entry")
        body += _STORE.pack(rec.timestamp_us, rec.tier, n) + rec.hashes
        body += array("i", rec.tokens).tobytes() if n else b""
    elif rec.kind == REMOVE:
        n = len(rec.hashes) // 8
        if len(rec.hashes) != 8 * n:
            raise BatchError("REMOVE: 8 bytes per hash")
        body += _REMOVE.pack(rec.timestamp_us, n) + rec.hashes
    elif rec.kind == CLEAR:
        body += _TS.pack(rec.timestamp_us)
    elif rec.kind == STATS:
        s = rec.stats or Stats()
        body += _STATS.pack(rec.timestamp_us, s.cache_memory_bytes, s.hit_rate, s.pressure,
                            s.t2_hit_tokens, s.t2_query_tokens)  # fmt: skip
    else:
        raise BatchError(f"unknown record kind {rec.kind}")
    return _REC.pack(rec.kind, len(body)) + body


def encode(records: Sequence[Record], appended_us: int = 0) -> bytes:
    """A batch of ``records``; ``appended_us`` is the appender's clock (0: the applier's)."""
    return _HEAD.pack(MAGIC, appended_us) + b"".join(encode_record(r) for r in records)


# -- reading (the reference) -------------------------------------------------------------------


def appended_us(batch: bytes) -> int:
    if len(batch) < HEADER or batch[:4] != MAGIC:
        raise BatchError("not an ICB1 batch")
    return int(_HEAD.unpack_from(batch)[1])


def _read_route(buf: bytes, pos: int, end: int) -> tuple[Route, int]:
    strs: list[str] = []
    try:
        for _ in range(5):
            (n,) = _U32.unpack_from(buf, pos)
            pos += 4
            if pos + n > end:
                raise BatchError("route past the end of its record")
            strs.append(buf[pos : pos + n].decode())
            pos += n
    except (struct.error, UnicodeDecodeError) as e:
        raise BatchError(f"malformed route: {e}") from None
    return Route(*strs), pos


def record_at(batch: bytes, offset: int) -> tuple[Record, int]:
    """The record at ``offset`` and the offset after it; ``BatchError`` when malformed."""
    try:
        kind, size = _REC.unpack_from(batch, offset)
        pos = offset + _REC.size
        end = pos + size
        if end > len(batch):
            raise BatchError("record past the end of the batch")
        route, pos = _read_route(batch, pos, end)
        if kind == STORE:
            ts, tier, n = _STORE.unpack_from(batch, pos)
            pos += _STORE.size
            if end - pos != 12 * n:
                raise BatchError("STORE: size does not match its entry count")
            tokens = array("i")
            tokens.frombytes(batch[pos + 8 * n : end])
            return Record(kind, route, ts, tier, batch[pos : pos + 8 * n], tokens), end
        if kind == REMOVE:
            ts, n = _REMOVE.unpack_from(batch, pos)
            pos += _REMOVE.size
            if end - pos != 8 * n:
                raise BatchError("REMOVE: size does not match its hash count")
            return Record(kind, route, ts, hashes=batch[pos:end]), end
        if kind == CLEAR:
            (ts,) = _TS.unpack_from(batch, pos)
            if end - pos != _TS.size:
                raise BatchError("CLEAR: wrong size")
            return Record(kind, route, ts), end
        if kind == STATS:
            ts, mem, hit, pressure, t2h, t2q = _STATS.unpack_from(batch, pos)
            if end - pos != _STATS.size:
                raise BatchError("STATS: wrong size")
            return Record(kind, route, ts, stats=Stats(mem, hit, pressure, t2h, t2q)), end
        raise BatchError(f"unknown record kind {kind}")
    except (struct.error, UnicodeDecodeError) as e:
        raise BatchError(f"malformed record at {offset}: {e}") from None


def _has_kind(batch: bytes, kind: int) -> bool:
    """Whether any record of the batch is of ``kind`` (headers only; malformed: False, the
    applier reports it)."""
    pos, n = HEADER, len(batch)
    try:
        while pos < n:
            k, size = _REC.unpack_from(batch, pos)
            if k == kind:
                return True
            pos += _REC.size + size
    except struct.error:
        return False
    return False


def records(batch: bytes) -> Iterator[Record]:
    appended_us(batch)
    pos = HEADER
    while pos < len(batch):
        rec, pos = record_at(batch, pos)
        yield rec


def tenants(batch: bytes) -> set[str]:
    """The tenants a batch's records name (what an authorization check needs), reading only
    each record's first route field; ``BatchError`` when malformed."""
    appended_us(batch)
    out: set[str] = set()
    pos = HEADER
    try:
        while pos < len(batch):
            _kind, size = _REC.unpack_from(batch, pos)
            start = pos + _REC.size
            end = start + size
            (n,) = _U32.unpack_from(batch, start)
            if end > len(batch) or start + 4 + n > end:
                raise BatchError("record past the end of the batch")
            out.add(batch[start + 4 : start + 4 + n].decode())
            pos = end
    except (struct.error, UnicodeDecodeError) as e:
        raise BatchError(f"malformed record at {pos}: {e}") from None
    return out


# -- applying ------------------------------------------------------------------------------------


def apply_record(st: IndexState, rec: Record, default_ts: int) -> None:
    """One record through the reference rules (``apply.py``), then the tenant quota and the
    global cap after a STORE or STATS, as ``Index.apply_update`` does after an update."""
    r = rec.route
    ts = rec.timestamp_us or default_ts
    if rec.kind in (STORE, STATS):
        entries = [LegacyRun(rec.hashes, list(rec.tokens), rec.tier, "")] if rec.kind == STORE \
            else []  # fmt: skip
        update = PackedUpdate(r.replica, r.model, r.tenant, r.scheme, ts, entries, rec.stats,
                              r.adapter)  # fmt: skip
        if apply.apply_update(st, update, ts):
            if r.tenant != PROBE_TENANT:
                eviction.enforce_quota(st, r.tenant)
            eviction.enforce_cap(st)
        return
    if rec.kind == REMOVE:
        h = rec.hashes
        event = Event(int(EventType.PREFIX_EVICTED), r.replica, r.model, r.tenant, h[:8], ts,
                      r.adapter, [h[i : i + 8] for i in range(8, len(h), 8)])  # fmt: skip
    else:
        event = Event(int(EventType.ALL_CLEARED), r.replica, r.model, r.tenant, b"", ts)
    apply.apply_event(st, event, ts)


def apply_reference(st: IndexState, batch: bytes, now_us: int) -> None:
    """Every record through ``apply_record`` (the reference of the compiled applier)."""
    default_ts = appended_us(batch) or now_us
    for rec in records(batch):
        apply_record(st, rec, default_ts)


Resolver = Callable[[int, bytes], tuple[object, int]]


def resolver(st: IndexState) -> Resolver:
    """What the compiled applier asks once per distinct route: for STORE (store, replica id,
    partition), None to skip (probe tenant) or () to hand the record to Python; for REMOVE
    (replica id, partition, store, ...) of every partition the event reaches, or None when
    nothing can be held. Returned with the index's generation: the applier forgets its cache
    when the generation moves."""

    def resolve(kind: int, route: bytes) -> tuple[object, int]:
        r, _ = _read_route(route, 0, len(route))
        value: object
        if r.tenant == PROBE_TENANT:
            value = None
        elif kind == STORE:
            settings = st.settings
            if not r.scheme or settings.max_entries_per_update <= 0 or settings.max_hash_bytes < 8:
                value = ()  # the reference drops (and counts) entries: no partition to make
            elif bounds.refuse_holds(st, r.tenant, r.model, r.replica) is not None:
                value = ()  # over a per-producer bound: the reference refuses and counts it
            else:
                part = st.partition(r.tenant, r.model, r.scheme, r.adapter)
                value = (part.store, st.replicas.intern(r.replica), part)
        else:
            rid = st.replicas.get(r.replica)
            parts = st.parts_by_tm.get((r.tenant, r.model))
            if rid is None or not parts:
                value = None
            else:
                flat: list[object] = [rid]
                for part in parts.values():
                    if not r.adapter or part.adapter == r.adapter:
                        flat += (part, part.store)
                value = tuple(flat) if len(flat) > 1 else None
        return value, st.generation

    return resolve


class Applier:
    """Applies batches to one index state: the compiled ``_blockmap.Applier`` for STORE and
    REMOVE records, this module for everything else (and for all when it is not built or the
    store backend is not the compiled one)."""

    def __init__(self, st: IndexState, compiled: Callable[[Resolver], object] | None) -> None:
        self._st = st
        self._c = compiled(resolver(st)) if compiled is not None else None
        self._apply = getattr(self._c, "apply", None)

    def apply(self, batch: bytes, now_us: int) -> None:
        """Apply every record in order. While the change feed is observed
        (``st.changes``), STORE records still take the compiled path and are reported from the
        records themselves (every hash of an applied STORE is written); a batch with a REMOVE
        record takes the reference, which reports exactly the holds it removed."""
        st = self._st
        c_apply = self._apply
        observed = st.changes is not None
        if c_apply is None or (observed and _has_kind(batch, REMOVE)):
            apply_reference(st, batch, now_us)
            return
        settings = st.settings
        max_entries = settings.max_entries_per_update
        max_hash = settings.max_hash_bytes
        n = len(batch)
        if n < HEADER or not batch.startswith(MAGIC):
            raise BatchError("not an ICB1 batch")
        pos = HEADER
        while pos < n:
            # quota, cap and the cap pool need a look after every STORE (as after an update)
            check = bool(st.policies.quotas) or settings.max_holds > 0 or st.cap_pool is not None
            deltas, nxt, defer = c_apply(
                batch, pos, now_us, st.generation, max_entries, max_hash, check
            )
            if deltas:
                changed = st.changed
                for part, rid, dk, dh in deltas:
                    changed(part, rid, dk, dh)
            if observed and nxt > pos:
                self._report_stores(batch, pos, nxt, appended_us(batch) or now_us)
            if check and nxt > pos and not defer:
                self._after(batch, pos, nxt, appended_us(batch) or now_us)
            pos = nxt
            if defer:
                rec, pos = record_at(batch, pos)
                apply_record(st, rec, appended_us(batch) or now_us)

    def _report_stores(self, batch: bytes, start: int, stop: int, default_ts: int) -> None:
        """The change feed's PREFIX_ADDED for the STORE records the compiled applier just
        wrote (records it skips: the probe tenant, and those it hands to Python, which
        report themselves)."""
        st = self._st
        changes = st.changes
        assert changes is not None
        limit = st.settings.max_entries_per_update
        pos = start
        while pos < stop:
            rec, pos = record_at(batch, pos)
            r = rec.route
            if rec.kind != STORE or r.tenant == PROBE_TENANT or not rec.hashes:
                continue
            hashes = rec.hashes if len(rec.hashes) <= 8 * limit else rec.hashes[: 8 * limit]
            changes.append(Change(PREFIX_ADDED, r.tenant, r.model, r.adapter, r.replica, hashes,
                                  rec.timestamp_us or default_ts))  # fmt: skip

    def _after(self, batch: bytes, start: int, stop: int, default_ts: int) -> None:
        """The quota and cap rules after the compiled applier's last STORE (it stops after
        each one when they apply), and the cap pool's note of the write."""
        st = self._st
        pos = start
        last: Record | None = None
        while pos < stop:
            rec, pos = record_at(batch, pos)
            if rec.kind == STORE:
                last = rec
        if last is None or last.route.tenant == PROBE_TENANT or not last.route.scheme:
            return
        if st.cap_pool is not None:
            eviction.note_upsert(st, last.timestamp_us or default_ts)
        eviction.enforce_quota(st, last.route.tenant)
        eviction.enforce_cap(st)
