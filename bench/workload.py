"""The seeded KV-cache workload shared by both sides of the Dynamo comparison, and its oracle.

Standard library only: the same pickled ``Workload`` is read by our side (project venv) and by
Dynamo's side (``bench/.venv-peers``), so both replay exactly the same events and queries.

The generator (``generate(params)``; every choice comes from ``random.Random(params.seed)``):

- **Content.** A block is one node of a global content tree: ``block_parent[b]`` (-1 = root) and
  ``block_tokens[b]`` (``block_size`` random token ids below 128,000). Block ids grow in creation
  order, so a parent always has a smaller id. A block id therefore names a whole prefix, and
  ``engine_hash[b]`` (splitmix64 of the id, 63 bits) is identical on every worker that caches
  that content, as vLLM's seeded sha256 is and as Dynamo's tree requires (a node keeps the first
  worker's engine hash; a different one on another worker breaks its ``parent_hash`` lookups).
- **Sequences** (prompts). ``families`` system prompts of 4-24 blocks, chosen with weights
  1/(rank+1). A new sequence either continues a recent conversation of that family (50 %: the
  previous sequence plus a 1-8 block turn, at most ``max_seq_blocks``) or starts one (the family
  prompt plus 2-16 fresh blocks).
- **Steps.** Each step one worker serves one sequence: 30 % a new sequence, else a recent one
  (rank-weighted over the last 256). The worker is sticky per family half of the time
  (``family % workers``), else uniform, so popular prefixes sit on several workers. Serving
  stores the sequence's blocks after the worker's cached leading run as one ``STORED`` batch
  (parent = the last cached block), after one ``REMOVED`` batch that evicts random *leaves* of the
  worker's cache until ``capacity`` blocks fit. With probability ``clear_prob`` a step is instead
  a ``CLEARED`` batch (the engine reset its prefix cache).
- **Eviction of leaves only** keeps every worker's cached set prefix-closed (a cached block's
  parent is cached), as vLLM's reverse-order block freeing does. That is what makes Dynamo's
  per-node worker counts equal to leading runs, so one oracle judges both sides.
- **Queries.** 70 % a recent sequence plus 0-4 novel blocks (never stored), 15 % a strict prefix
  of one, 10 % an older sequence, 5 % entirely novel content. Novel blocks are content-tree
  children too (so our chained fingerprints and Dynamo's per-block hashes both exist for them).
- **Event** = one batch for one worker step (``STORED``, ``REMOVED`` or ``CLEARED``), counted
  the same way for both sides whatever the number of calls a side needs to apply it.

The oracle replays the events on per-worker sets of cached block ids and answers a query with
each worker's leading run (blocks from the first one, while cached), omitting zeros.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

STORED = 0
REMOVED = 1
CLEARED = 2

VOCAB = 128_000
_MASK64 = (1 << 64) - 1

# One event: (worker, kind, block ids). STORED ids are a path whose first parent is cached.
Event = tuple[int, int, list[int]]
Answer = dict[int, int]  # worker -> leading run in blocks (> 0 only)


@dataclass(frozen=True)
class Params:
    """Size and shape of one workload (see the module docstring)."""

    seed: int = 20260101
    workers: int = 8
    block_size: int = 16
    steps: int = 20_000
    capacity: int = 2_000  # blocks per worker; must be >= max_seq_blocks
    families: int = 24
    max_seq_blocks: int = 128
    queries: int = 2_000
    clear_prob: float = 0.0005
    checkpoints: int = 4  # verification points spread over the events
    verify_queries: int = 300  # queries answered at every checkpoint

    def __post_init__(self) -> None:
        if self.capacity < self.max_seq_blocks:
            raise ValueError("capacity must be >= max_seq_blocks")


SMOKE = Params(workers=3, steps=400, capacity=160, families=6, max_seq_blocks=64, queries=120,
               clear_prob=0.005, checkpoints=8, verify_queries=120)
QUICK = Params(workers=8, steps=12_000, capacity=1_500, queries=2_000)
FULL = Params(workers=16, steps=60_000, capacity=4_000, queries=10_000, checkpoints=6,
              verify_queries=500)


@dataclass
class Workload:
    """Everything both sides replay; plain picklable data."""

    params: Params
    block_parent: list[int] = field(default_factory=list)
    block_tokens: list[list[int]] = field(default_factory=list)
    engine_hash: list[int] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    queries: list[list[int]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)  # event counts after which to verify

    @property
    def block_size(self) -> int:
        return self.params.block_size

    def depth(self) -> list[int]:
        """Blocks from the root to each block, inclusive."""
        out: list[int] = []
        for p in self.block_parent:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def to_plain(self) -> dict[str, Any]:
        """Builtins only, for a process that cannot import this module (the peer venv)."""
        return {
            "block_size": self.params.block_size,
            "workers": self.params.workers,
            "verify_queries": self.params.verify_queries,
            "block_parent": self.block_parent,
            "block_tokens": self.block_tokens,
            "engine_hash": self.engine_hash,
            "events": self.events,
            "queries": self.queries,
            "checkpoints": self.checkpoints,
        }

    def stats(self) -> dict[str, float]:
        ev = self.events
        stored = sum(len(ids) for _, k, ids in ev if k == STORED)
        removed = sum(len(ids) for _, k, ids in ev if k == REMOVED)
        return {
            "events": len(ev),
            "stored_events": sum(1 for _, k, _ids in ev if k == STORED),
            "removed_events": sum(1 for _, k, _ids in ev if k == REMOVED),
            "cleared_events": sum(1 for _, k, _ids in ev if k == CLEARED),
            "stored_blocks": stored,
            "removed_blocks": removed,
            "blocks": len(self.block_parent),
            "queries": len(self.queries),
            "query_blocks_mean": sum(map(len, self.queries)) / max(1, len(self.queries)),
        }


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _Cache:
    """One worker's prefix-closed cache: cached ids, cached-children counts, a sampleable
    list of leaves."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.children: dict[int, int] = {}
        self.leaves: list[int] = []
        self.leaf_pos: dict[int, int] = {}

    def _add_leaf(self, b: int) -> None:
        self.leaf_pos[b] = len(self.leaves)
        self.leaves.append(b)

    def _drop_leaf(self, b: int) -> None:
        i = self.leaf_pos.pop(b)
        last = self.leaves.pop()
        if last != b:
            self.leaves[i] = last
            self.leaf_pos[last] = i

    def add(self, b: int, parent: int) -> None:
        self.cached.add(b)
        self.children[b] = 0
        self._add_leaf(b)
        if parent >= 0:
            if self.children[parent] == 0:
                self._drop_leaf(parent)
            self.children[parent] += 1

    def remove_leaf(self, b: int, parent: int) -> None:
        self.cached.discard(b)
        del self.children[b]
        self._drop_leaf(b)
        if parent >= 0:
            self.children[parent] -= 1
            if self.children[parent] == 0:
                self._add_leaf(parent)

    def clear(self) -> None:
        self.cached.clear()
        self.children.clear()
        self.leaves.clear()
        self.leaf_pos.clear()


def generate(params: Params) -> Workload:
    """Build the workload of ``params`` (deterministic)."""
    rnd = random.Random(params.seed)
    w = Workload(params)
    bs = params.block_size

    def new_block(parent: int) -> int:
        b = len(w.block_parent)
        w.block_parent.append(parent)
        w.block_tokens.append([rnd.randrange(VOCAB) for _ in range(bs)])
        w.engine_hash.append(splitmix64(b) >> 1)
        return b

    def extend(path: list[int], n: int) -> list[int]:
        out = list(path)
        for _ in range(n):
            out.append(new_block(out[-1] if out else -1))
        return out

    fam_prompt = [extend([], rnd.randint(4, 24)) for _ in range(params.families)]
    fam_weights = [1.0 / (i + 1) for i in range(params.families)]
    fam_last: list[list[int] | None] = [None] * params.families
    seqs: list[tuple[int, list[int]]] = []  # (family, path)

    def new_sequence() -> tuple[int, list[int]]:
        f = rnd.choices(range(params.families), fam_weights)[0]
        last = fam_last[f]
        if last is not None and rnd.random() < 0.5:
            turn = rnd.randint(1, 8)
            if len(last) + turn <= params.max_seq_blocks:
                path = extend(last, turn)
                fam_last[f] = path
                return f, path
        path = extend(fam_prompt[f], rnd.randint(2, 16))
        path = path[: params.max_seq_blocks]
        fam_last[f] = path
        return f, path

    def recent(window: int = 256) -> tuple[int, list[int]]:
        k = min(window, len(seqs))
        # rank-weighted: the most recent sequence is the most likely
        r = int(k * rnd.random() ** 2)
        return seqs[len(seqs) - 1 - min(r, k - 1)]

    caches = [_Cache() for _ in range(params.workers)]
    parent = w.block_parent
    for _ in range(params.steps):
        if rnd.random() < params.clear_prob:
            wk = rnd.randrange(params.workers)
            if caches[wk].cached:
                caches[wk].clear()
                w.events.append((wk, CLEARED, []))
            continue
        if not seqs or rnd.random() < 0.3:
            fam, path = new_sequence()
            seqs.append((fam, path))
        else:
            fam, path = recent()
        wk = fam % params.workers if rnd.random() < 0.5 else rnd.randrange(params.workers)
        c = caches[wk]
        hit = 0
        while hit < len(path) and path[hit] in c.cached:
            hit += 1
        new = path[hit:]
        if not new:
            continue
        overflow = len(c.cached) + len(new) - params.capacity
        if overflow > 0:
            keep = path[hit - 1] if hit else -1
            evicted: list[int] = []
            while overflow > 0:
                victim = c.leaves[rnd.randrange(len(c.leaves))]
                if victim == keep:
                    continue
                c.remove_leaf(victim, parent[victim])
                evicted.append(victim)
                overflow -= 1
            w.events.append((wk, REMOVED, evicted))
        for b in new:
            c.add(b, parent[b])
        w.events.append((wk, STORED, new))

    for _ in range(params.queries):
        u = rnd.random()
        if u < 0.70:
            path = extend(recent()[1], rnd.choice((0, 0, 1, 2, 4)))
        elif u < 0.85:
            base = recent()[1]
            path = base[: rnd.randint(1, max(1, len(base) - 1))]
        elif u < 0.95:
            path = rnd.choice(seqs)[1]
        else:
            path = extend([], rnd.randint(2, 32))
        w.queries.append(path)

    n = len(w.events)
    k = max(1, params.checkpoints)
    w.checkpoints = sorted({max(1, n * (i + 1) // k) for i in range(k)})
    return w


def add_sentinel(wl: Workload, n_blocks: int = 4) -> list[int]:
    """Append a completion sentinel on worker 0 and return its path (fresh content).

    Events: store ``path[:-1]``, remove ``path[-2]``, store ``path[-2:]``. Only the last event
    makes the whole path answer in full, and it re-stores a block removed just before, which no
    indexer may apply ahead of that removal (nor, as both apply runs of events in order, ahead of
    any earlier event). So "the path answers in full" proves every event was applied. A plain last
    store would not: our subscriber sends adds that commute with queued evictions ahead of them
    (same final state), and an ordinary sequence may have answered in full earlier in the stream.
    """
    assert n_blocks >= 2
    rnd = random.Random(wl.params.seed ^ 0x5E17)
    path: list[int] = []
    for _ in range(n_blocks):
        b = len(wl.block_parent)
        wl.block_parent.append(path[-1] if path else -1)
        wl.block_tokens.append([rnd.randrange(VOCAB) for _ in range(wl.params.block_size)])
        wl.engine_hash.append(splitmix64(b) >> 1)
        path.append(b)
    wl.events.append((0, STORED, path[:-1]))
    wl.events.append((0, REMOVED, [path[-2]]))
    wl.events.append((0, STORED, path[-2:]))
    return path


class Oracle:
    """Per-worker sets of cached block ids, replayed from the events."""

    def __init__(self, wl: Workload) -> None:
        self.wl = wl
        self.cached: list[set[int]] = [set() for _ in range(wl.params.workers)]
        self.applied = 0

    def apply_until(self, n_events: int) -> None:
        parent = self.wl.block_parent
        for wk, kind, ids in self.wl.events[self.applied : n_events]:
            c = self.cached[wk]
            if kind == STORED:
                p = parent[ids[0]]
                assert p < 0 or p in c, "stored batch without its parent"
                c.update(ids)
            elif kind == REMOVED:
                c.difference_update(ids)
            else:
                c.clear()
        self.applied = max(self.applied, n_events)

    def answer(self, query: list[int]) -> Answer:
        out: Answer = {}
        for wk, c in enumerate(self.cached):
            run = 0
            for b in query:
                if b not in c:
                    break
                run += 1
            if run:
                out[wk] = run
        return out

    def answers(self, queries: list[list[int]]) -> list[Answer]:
        return [self.answer(q) for q in queries]


def compare(side: str, got: list[Answer], want: list[Answer], limit: int = 5) -> list[str]:
    """Human-readable mismatches between a side's answers and the oracle's (empty = all right)."""
    errs: list[str] = []
    if len(got) != len(want):
        return [f"{side}: {len(got)} answers for {len(want)} queries"]
    for i, (g, x) in enumerate(zip(got, want, strict=True)):
        if g != x:
            errs.append(f"{side}: query {i}: got {g}, oracle {x}")
            if len(errs) >= limit:
                break
    return errs
