"""The pure-Python ``PartitionStore``: reference of the compiled store, and its fallback.

It implements the operations every backend must (``store.PartitionStore``) and one capability,
``upsert_many`` (the ingest path: ~3x the default's loop of ``upsert`` calls); the other batch
and bulk operations, the ranked walk and the eviction candidates are the plain defaults of
``store.py``, so the index suite, run once per backend, checks those defaults against the
compiled store's own versions (``tests/index/test_store.py`` also runs a store with the required
operations only).

Layout, chosen for memory first: one dict ``key bytes -> holders``. Most keys have a single
holder, so a single holder is stored inline as a 5-tuple ``(replica, tokens, last_seen, tier,
access)``; only a key with two or more holders pays for an inner dict ``replica -> (tokens,
last_seen, tier, access)``. No per-hold objects beyond that tuple. A chain walk tracks runs in a
few locals while a single replica runs (the common case) and sums the request's token counts
once at the end with C-level ``sum`` over a slice, so the per-block Python work is one slice,
one dict probe and a couple of compares.

The full-scan operations (the defaults of ``sweep``, ``cap_candidates``, ``quota_candidates``,
``remove_replica``, ``remove_key``) are O(holds of the partition); the compiled store is the
production path for large indexes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Union

from inferencecache.fingerprint import split_packed
from inferencecache.index.store import (
    HOLD_REMOVED,
    KEY_REMOVED,
    NEW_HOLD,
    NEW_KEY,
    Hold,
    Run,
    split_keys,
)

# holder forms: inline single holder, or replica -> (tokens, last_seen, tier, access)
_Single = tuple[int, int, int, int, int]
_Multi = dict[int, tuple[int, int, int, int]]
_Holders = Union[_Single, _Multi]  # noqa: UP007 - a runtime alias needs Union on 3.11


_CHUNK = 64
"""Blocks probed per C-level ``map`` in a single-replica walk (bounds wasted probes after a
run ends)."""


def _split(packed: bytes) -> list[bytes]:
    """Packed 8-byte keys -> a list; a trailing partial key is ignored (as by the C store)."""
    return list(split_keys(packed))


def wrap32(x: int) -> int:
    """Two's complement int32 wrap (contract-and-index.md §5.5 "Integers")."""
    return ((x + 0x8000_0000) & 0xFFFF_FFFF) - 0x8000_0000


class MemStore:
    """Holds of one partition in plain dicts (see module doc for the layout)."""

    __slots__ = ("_holds", "_m")

    def __init__(self) -> None:
        self._m: dict[bytes, _Holders] = {}
        self._holds = 0

    # -- counts ---------------------------------------------------------------------------

    def key_count(self) -> int:
        return len(self._m)

    def hold_count(self) -> int:
        return self._holds

    # -- writes ---------------------------------------------------------------------------

    def upsert(self, key: bytes, replica: int, tokens: int, last_seen: int, tier: int) -> int:
        m = self._m
        v = m.get(key)
        if v is None:
            m[key] = (replica, tokens, last_seen, tier, 0)
            self._holds += 1
            return NEW_KEY | NEW_HOLD
        if isinstance(v, tuple):
            if v[0] == replica:
                m[key] = (replica, tokens, last_seen, tier, v[4])
                return 0
            m[key] = {v[0]: (v[1], v[2], v[3], v[4]), replica: (tokens, last_seen, tier, 0)}
            self._holds += 1
            return NEW_HOLD
        h = v.get(replica)
        if h is None:
            v[replica] = (tokens, last_seen, tier, 0)
            self._holds += 1
            return NEW_HOLD
        v[replica] = (tokens, last_seen, tier, h[3])
        return 0

    def upsert_many(
        self,
        keys: Sequence[bytes] | bytes,
        tokens: Sequence[int],
        replica: int,
        last_seen: int,
        tier: int,
    ) -> tuple[int, int]:
        if isinstance(keys, bytes):
            keys = _split(keys)
        m = self._m
        new_keys = 0
        new_holds = 0
        get = m.get
        for key, tok in zip(keys, tokens, strict=False):
            v = get(key)
            if v is None:
                m[key] = (replica, tok, last_seen, tier, 0)
                new_keys += 1
                new_holds += 1
            elif isinstance(v, tuple):
                if v[0] == replica:
                    m[key] = (replica, tok, last_seen, tier, v[4])
                else:
                    m[key] = {v[0]: (v[1], v[2], v[3], v[4]), replica: (tok, last_seen, tier, 0)}
                    new_holds += 1
            else:
                h = v.get(replica)
                if h is None:
                    v[replica] = (tok, last_seen, tier, 0)
                    new_holds += 1
                else:
                    v[replica] = (tok, last_seen, tier, h[3])
        self._holds += new_holds
        return new_keys, new_holds

    def credit(self, keys: Sequence[bytes] | bytes, blocks: int, replica: int) -> None:
        m = self._m
        if blocks <= 0:
            return
        seq = split_packed(keys[: 8 * blocks]) if isinstance(keys, bytes) else keys[:blocks]
        for key in seq:
            v = m.get(key)
            if v is None:
                continue
            if isinstance(v, tuple):
                if v[0] == replica:
                    m[key] = (v[0], v[1], v[2], v[3], v[4] + 1)
            else:
                h = v.get(replica)
                if h is not None:
                    v[replica] = (h[0], h[1], h[2], h[3] + 1)

    def remove_hold(self, key: bytes, replica: int) -> int:
        m = self._m
        v = m.get(key)
        if v is None:
            return 0
        if isinstance(v, tuple):
            if v[0] != replica:
                return 0
            del m[key]
            self._holds -= 1
            return HOLD_REMOVED | KEY_REMOVED
        if v.pop(replica, None) is None:
            return 0
        self._holds -= 1
        if len(v) == 1:
            ((r, h),) = v.items()
            m[key] = (r, h[0], h[1], h[2], h[3])
        return HOLD_REMOVED

    # -- reads ----------------------------------------------------------------------------

    def holders(self, key: bytes, fresh_after: int) -> list[tuple[int, int, int, int]]:
        v = self._m.get(key)
        if v is None:
            return []
        if isinstance(v, tuple):
            if v[2] > fresh_after:
                return [(v[0], v[1], v[2], v[3])]
            return []
        return [(r, h[0], h[1], h[2]) for r, h in v.items() if h[1] > fresh_after]

    def walk(
        self, keys: Sequence[bytes] | bytes, counts: Sequence[int], fresh_after: int
    ) -> list[Run]:
        m = self._m
        if isinstance(keys, bytes):
            n = min(len(keys) >> 3, len(counts))
            k0 = keys[0:8]
        else:
            n = min(len(keys), len(counts))
            k0 = keys[0] if n else b""
        if n == 0:
            return []
        v = m.get(k0)
        if v is None:
            return []
        # past a block-0 hit, split packed keys once (in C when the accelerator is built)
        seq: Sequence[bytes] = split_packed(keys[: 8 * n]) if isinstance(keys, bytes) else keys
        # runs: replica -> [oldest, tier, blocks]
        if isinstance(v, tuple):
            if v[2] <= fresh_after:
                return []
            runs: dict[int, list[int]] = {v[0]: [v[2], v[3], 1]}
        else:
            runs = {r: [h[1], h[2], 1] for r, h in v.items() if h[1] > fresh_after}
            if not runs:
                return []
        final: list[tuple[int, list[int]]] = []
        i = 1
        while i < n and runs:
            if len(runs) == 1:
                # Tight loop while a single replica runs (the common case): dict probes in
                # C-level chunks (map), a few compares per block in Python.
                ((r, run),) = runs.items()
                oldest, tier, blocks = run
                get = m.get
                stop = False
                while i < n and not stop:
                    chunk = list(map(get, seq[i : min(n, i + _CHUNK)]))
                    i += len(chunk)
                    for v in chunk:
                        if v is None:
                            stop = True
                            break
                        if isinstance(v, tuple):
                            if v[0] != r:
                                stop = True
                                break
                            ts = v[2]
                            t = v[3]
                        else:
                            h = v.get(r)
                            if h is None:
                                stop = True
                                break
                            ts = h[1]
                            t = h[2]
                        if ts <= fresh_after:
                            stop = True
                            break
                        if ts < oldest:
                            oldest = ts
                        if t > tier:
                            tier = t
                        blocks += 1
                final.append((r, [oldest, tier, blocks]))
                runs = {}
                break
            v = m.get(seq[i])
            if v is None:
                break
            if isinstance(v, tuple):
                # A single holder continues one run at most, so this happens once per walk
                # (then the single-replica loop above takes over): take the multi-holder form.
                v = {v[0]: v[1:]}
            cont: dict[int, list[int]] = {}
            for r, run in runs.items():
                h = v.get(r)
                if h is not None and h[1] > fresh_after:
                    if h[1] < run[0]:
                        run[0] = h[1]
                    if h[2] > run[1]:
                        run[1] = h[2]
                    run[2] += 1
                    cont[r] = run
            if len(cont) != len(runs):
                final.extend((r, run) for r, run in runs.items() if r not in cont)
            runs = cont
            i += 1
        final.extend(runs.items())
        out: list[Run] = []
        sums: dict[int, int] = {}
        for r, (oldest, tier, blocks) in final:
            tokens = sums.get(blocks)
            if tokens is None:
                tokens = wrap32(sum(counts[:blocks]))
                sums[blocks] = tokens
            out.append(Run(r, tokens, oldest, tier, blocks))
        return out

    def holds(self) -> Iterator[Hold]:
        for key, v in list(self._m.items()):
            if isinstance(v, tuple):
                yield Hold(key, v[0], v[1], v[2], v[3], v[4])
            else:
                for r, h in list(v.items()):
                    yield Hold(key, r, h[0], h[1], h[2], h[3])
