"""The index state as bytes and back: what an event-log snapshot stores (docs/event-log.md).

Why here: only the index knows which of its fields are state and which are derived. A dump
keeps the state a replica needs to answer and to go on applying the log exactly as a replica
that never restarted: every hold (key, replica, tokens, last_seen, tier), every stats row, the
replica and partition id tables (ids are handed out lowest-free-first, so a restored table must
hand out the same ids next), and the partitions in their order. Everything else (the views,
reference counts, the cap pool, the id pools) is recomputed on load. LFU access counts are
replica-local (docs/decisions.md) and not stored; neither is the reserved probe tenant (the
``/probe`` self-test's holds are its own and always cleaned up by it).

Holds are stored per partition in *groups* of one (replica, last_seen, tier): one ingest stamps
all its blocks with the same time, so a group is usually a whole update and loads with a single
``upsert_many`` call (one compiled call per group with the native store).

Layout (all integers little-endian; ``str`` = u32 byte length + UTF-8):
- ``meta`` (JSON, UTF-8): replica names by id (null = free id), partitions
  ``[[pid, tenant, model, scheme, adapter, distinct keys], ...]`` in order, stats rows.
- one ``holds`` blob per partition, in the same order: u32 group count, then per group
  u32 replica id, i64 last_seen, i32 tier, u32 n, u8 form (0: n keys of 8 bytes; 1: n u32
  key lengths follow), the keys, then n i32 token counts.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from inferencecache.index.model import PROBE_TENANT
from inferencecache.index.state import IndexState, Partition, StatsRow
from inferencecache.index.store import Columns

FORMAT = 1
"""Version of the meta document and hold blobs (the snapshot file carries its own version)."""

_GROUP = struct.Struct("<IqiIB")
_U32 = struct.Struct("<I")
_LITTLE = sys.byteorder == "little"


class PersistError(ValueError):
    """A dump that cannot be loaded (truncated, inconsistent, another format)."""


def _le(a: array[int]) -> bytes:
    if not _LITTLE:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _from_le(typecode: str, raw: bytes | memoryview) -> array[int]:
    a = array(typecode)
    a.frombytes(raw)
    if not _LITTLE:
        a.byteswap()
    return a


def dump_meta(st: IndexState) -> bytes:
    """The small part of the state (ids, partitions, stats rows) as JSON."""
    stats = [
        [tenant, model, [[rid, r.cache_memory_bytes, r.hit_rate, r.pressure, r.t2_hit_tokens,
                          r.t2_query_tokens, r.last_seen, r.stats_reported]
                         for rid, r in rows.items()]]
        for (tenant, model), rows in st.stats.items() if tenant != PROBE_TENANT
    ]  # fmt: skip
    doc = {
        "format": FORMAT,
        "replicas": list(st.replicas.names),
        "partitions": [[p.pid, *p.key, p.store.key_count()]
                       for p in st.parts.values() if not p.probe],
        "stats": stats,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


class Capture:
    """The state at one point, taken under the index lock (``capture``: the small meta document
    and a plain copy of each partition's holds); ``blobs()`` encodes it afterwards, outside
    the lock."""

    def __init__(self, meta: bytes, columns: list[Columns]) -> None:
        self.meta = meta
        self.columns = columns

    def blobs(self) -> list[bytes]:
        """``[meta, one holds blob per partition]``, as ``load`` reads them."""
        return [self.meta, *map(encode_holds, self.columns)]


def capture(st: IndexState) -> Capture:
    """Under the index lock: meta + each non-probe partition's holds as columns."""
    return Capture(dump_meta(st), [p.ops.dump_columns() for p in st.parts.values() if not p.probe])


def encode_holds(cols: Columns) -> bytes:
    """One partition's holds blob (see the module doc) from its columns."""
    keys, reps_b, toks_b, tss_b, tiers_b, others = cols
    reps = memoryview(reps_b).cast("I")
    toks = memoryview(toks_b).cast("i")
    tss = memoryview(tss_b).cast("q")
    tiers = memoryview(tiers_b).cast("i")
    groups: dict[tuple[int, int, int], tuple[bytearray, array[int]]] = {}
    get = groups.get
    kv = memoryview(keys)
    for i in range(len(reps)):
        g = (reps[i], tss[i], tiers[i])
        ent = get(g)
        if ent is None:
            ent = groups[g] = (bytearray(), array("i"))
        ent[0].extend(kv[8 * i : 8 * i + 8])
        ent[1].append(toks[i])
    long_groups: dict[tuple[int, int, int], tuple[list[bytes], array[int]]] = {}
    for key, rid, tok, ts, tier in others:
        lent = long_groups.get((rid, ts, tier))
        if lent is None:
            lent = long_groups[(rid, ts, tier)] = ([], array("i"))
        lent[0].append(key)
        lent[1].append(tok)
    out = [_U32.pack(len(groups) + len(long_groups))]
    for (rid, ts, tier), (kb, tk) in groups.items():
        out.append(_GROUP.pack(rid, ts, tier, len(tk), 0))
        out.append(bytes(kb))
        out.append(_le(tk))
    for (rid, ts, tier), (kl, tk) in long_groups.items():
        out.append(_GROUP.pack(rid, ts, tier, len(tk), 1))
        out.append(_le(array("I", map(len, kl))))
        out.append(b"".join(kl))
        out.append(_le(tk))
    return b"".join(out)


def iter_dump(st: IndexState) -> Iterator[bytes]:
    """``dump_meta`` then one holds blob per partition, in partition order."""
    yield from capture(st).blobs()


def load(st: IndexState, meta: bytes, blobs: Sequence[bytes]) -> None:
    """Fill an empty ``IndexState`` from ``dump_meta`` + the partition blobs; recomputes every
    view. Raises ``PersistError`` on anything inconsistent (the caller discards the state)."""
    if st.parts or st.stats or len(st.replicas):
        raise PersistError("load needs an empty index")
    try:
        doc = json.loads(meta)
        if doc.get("format") != FORMAT:
            raise PersistError(f"unknown state format {doc.get('format')!r}")
        _load_doc(st, doc, blobs)
    except PersistError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, struct.error, OverflowError) as e:
        raise PersistError(f"{type(e).__name__}: {e}") from e


def _load_doc(st: IndexState, doc: dict[str, Any], blobs: Sequence[bytes]) -> None:
    names = doc["replicas"]
    if not all(n is None or isinstance(n, str) for n in names):
        raise PersistError("bad replica table")
    interner = st.replicas
    interner._names = list(names)  # the facade moves them into the kept list object
    interner._refs = [0] * len(names)
    interner._ids = {n: i for i, n in enumerate(names) if n is not None}
    parts = doc["partitions"]
    pids = [int(p[0]) for p in parts]
    if len(set(pids)) != len(pids) or min(pids, default=0) < 0:
        raise PersistError("bad partition ids")
    if len(parts) != len(blobs):
        raise PersistError(f"{len(parts)} partitions but {len(blobs)} hold blobs")
    n_names = len(names)
    for (pid, tenant, model, scheme, adapter, n_keys), blob in zip(parts, blobs, strict=True):
        key = (str(tenant), str(model), str(scheme), str(adapter))
        part = Partition(int(pid), key, st.store_factory())
        part.ops.reserve(max(0, int(n_keys)))  # one table allocation, not a doubling series
        st.parts[key] = part
        st.parts_by_tm.setdefault(part.tm, {})[part.pid] = part
        st.parts_by_tenant.setdefault(part.tenant, {})[part.pid] = part
        st._tenant_ref(part.tenant, 1)  # the per-producer bounds' count (index/bounds.py)
        _load_holds(part, memoryview(blob), n_names)
        if not part.store.key_count():
            raise PersistError(f"empty partition {key!r}")
        st.keys_delta(part, part.store.key_count())
        for rid, (holds, _newest) in part.ops.replica_summary().items():
            if names[rid] is None:
                raise PersistError(f"hold of free replica id {rid}")
            st.holds_delta(part, rid, holds)
    for tenant, model, rows in doc["stats"]:
        tm = (str(tenant), str(model))
        for rid, mem, hit, pressure, t2h, t2q, last_seen, reported in rows:
            if not (0 <= rid < n_names) or names[rid] is None:
                raise PersistError(f"stats row of free replica id {rid}")
            row = StatsRow(int(mem), float(hit), float(pressure), int(t2h), int(t2q), 0)
            row.last_seen = int(last_seen)
            row.stats_reported = int(reported)
            st.put_stats(tm, rid, row)
    # ids are handed out lowest-free-first; which ids a replica has does not change any answer
    for name, rid in interner.items():
        if interner.refs(rid) == 0:  # only the probe tenant referred to it
            del interner._ids[name]
            interner._names[rid] = None
    interner._pool._next = len(interner._names)
    interner._pool._free = [i for i, n in enumerate(interner._names) if n is None]
    st._pids._next = max(pids, default=-1) + 1
    used = set(pids)
    st._pids._free = [i for i in range(st._pids._next) if i not in used]
    st._dirty_models.clear()
    st.dropped.clear()
    st.cap_pool = None


def _load_holds(part: Partition, blob: memoryview, n_names: int) -> None:
    (n_groups,) = _U32.unpack_from(blob, 0)
    pos = _U32.size
    upsert_many = part.ops.upsert_many
    for _ in range(n_groups):
        rid, ts, tier, n, form = _GROUP.unpack_from(blob, pos)
        pos += _GROUP.size
        if rid >= n_names:
            raise PersistError(f"replica id {rid} out of range")
        if form == 0:
            size = 8 * n
            keys: bytes | list[bytes] = bytes(blob[pos : pos + size])
        elif form == 1:
            lens = _from_le("I", blob[pos : pos + 4 * n])
            pos += 4 * n
            size = sum(lens)
            raw = bytes(blob[pos : pos + size])
            keys = []
            off = 0
            for ln in lens:
                keys.append(raw[off : off + ln])
                off += ln
        else:
            raise PersistError(f"unknown key form {form}")
        if len(blob) < pos + size + 4 * n:
            raise PersistError("truncated hold group")
        pos += size
        toks = _from_le("i", blob[pos : pos + 4 * n])
        pos += 4 * n
        _new_keys, new_holds = upsert_many(keys, toks, rid, ts, tier)
        if new_holds != n:
            raise PersistError("duplicate hold in a dump")
    if pos != len(blob):
        raise PersistError("trailing bytes after the hold groups")
