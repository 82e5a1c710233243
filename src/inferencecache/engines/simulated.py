"""The simulated engine's model: a finite prefix cache plus a queue, with no clock of its own.

Shared by the simulated engine server (:mod:`.openai`, real time on asyncio) and the cluster
simulator (:mod:`inferencecache.sim`, simulated time), so both measure the same engine:

* :class:`SimCache` is the fake engine's :class:`~.cache.BlockCache` with vLLM-like behaviour
  where it matters for routing: engine hashes come from one native chain call per prompt (the
  content fingerprint seeded per adapter, so the same tokens under two adapters are two blocks,
  and never equal to the routing fingerprint), a prompt's blocks are touched tail first so LRU
  eviction drops a chain's tail before its root (vLLM frees a finished request's blocks in
  reverse order), eviction costs O(evicted), and a hit is capped at ``len(prompt) - 1`` tokens
  (vLLM always recomputes the last prompt token).
* :class:`EngineModel` admits at most ``max_num_seqs`` sequences (the rest wait, FIFO); each
  admitted prompt's uncached tokens are prefilled by one FIFO compute lane at
  ``prefill_ms_per_token`` (so prefills of concurrent requests queue behind each other, as they
  share the accelerator), the first token appears when its prefill ends (= TTFT), and it holds
  its slot for ``decode_ms_per_token`` per further output token. Blocks are cached at admission,
  like vLLM's scheduler caches full blocks when it allocates them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar

import xxhash

from inferencecache.engines.cache import BlockCache, Inserted
from inferencecache.fingerprint import prefix_hashes

ENGINE_SALT = b"inferencecache-sim-engine\x00"

# Defaults of the engine-model flags, the same in every command that has them (``fake-engine
# --mode simulated``, ``demo``, ``simulate``); docs/demo.md's results were measured with them.
DEFAULT_MAX_NUM_SEQS: Final = 16
DEFAULT_PREFILL_MS_PER_TOKEN: Final = 0.1
DEFAULT_PREFILL_BASE_MS: Final = 1.0  # scheduling, sampling
DEFAULT_DECODE_MS_PER_TOKEN: Final = 2.0

K = TypeVar("K")


def adapter_seed(adapter: str) -> int:
    """The chain seed of an adapter's engine hashes (stable across processes, like vLLM ≥ 0.29)."""
    return int(xxhash.xxh3_64_intdigest(ENGINE_SALT + adapter.encode(), seed=0))


class SimCache(BlockCache):
    """A finite LRU prefix cache keyed by engine block hash (see the module doc)."""

    def __init__(self, block_size: int, capacity: int = 0) -> None:
        super().__init__(block_size, capacity)
        self._seeds: dict[str, int] = {}

    def chain(self, tokens: Sequence[int], adapter: str = "") -> list[int]:  # type: ignore[override]
        """Engine hashes of every full block of ``tokens`` under ``adapter``."""
        seed = self._seeds.get(adapter)
        if seed is None:
            seed = self._seeds[adapter] = adapter_seed(adapter)
        return prefix_hashes(tokens, self.block_size, parent=seed)

    @staticmethod
    def hit_cap(prompt_tokens: int, block_size: int) -> int:
        """Most blocks a prompt can hit: vLLM recomputes the last token, so ``(n - 1) // B``."""
        return max(0, (prompt_tokens - 1) // block_size)

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a chain already cached (no LRU touch: the oracle's view)."""
        lru = self._lru
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def cached_tokens(self, tokens: Sequence[int], adapter: str = "") -> int:
        """Tokens of ``tokens`` the engine would take from its cache right now."""
        bs = self.block_size
        hit = self.match(self.chain(tokens, adapter))
        return min(hit, self.hit_cap(len(tokens), bs)) * bs

    def insert(  # type: ignore[override]
        self,
        tokens: Sequence[int],
        adapter: str = "",
        hashes: Sequence[int] | None = None,
    ) -> Inserted:
        """Serve a prompt: reuse its cached leading blocks, cache the rest, evict LRU to fit.

        ``Inserted.hit_blocks`` is the raw leading run (the hit counters cap it, see
        :meth:`hit_cap`). Blocks after the first miss are (re)stored even if some were still
        cached, the way an engine recomputes everything after a miss.
        """
        if hashes is None:
            hashes = self.chain(tokens, adapter)
        lru = self._lru
        hit = self.match(hashes)
        # Touch tail first so the root is the most recent: LRU then evicts chain tails first,
        # and the hits are safe from the eviction below.
        for h in reversed(hashes[:hit]):
            lru.move_to_end(h)
        result = Inserted(hit)
        n = len(hashes)
        if hit < n:
            new = list(hashes[hit:])
            cap = self.capacity
            if cap:
                missing = sum(1 for h in new if h not in lru)
                overflow = len(lru) + missing - cap
                if overflow > 0:
                    keep = set(new)
                    evictable = len(lru) - hit - (len(new) - missing)
                    overflow = min(overflow, evictable)
                    evicted = result.evicted
                    while overflow > 0:
                        victim, _ = lru.popitem(last=False)
                        if victim in keep:
                            lru[victim] = None  # re-stored below anyway
                            continue
                        evicted.append(victim)
                        overflow -= 1
            # New blocks go in front of the hits' tail-first order: tail oldest, root newest.
            for h in reversed(new):
                lru[h] = None
                lru.move_to_end(h)
            for h in reversed(hashes[:hit]):
                lru.move_to_end(h)
            bs = self.block_size
            result.stored = new
            result.parent = hashes[hit - 1] if hit else None
            result.stored_tokens = list(tokens[hit * bs : n * bs])
        return result


class EngineFlags(Protocol):
    """The engine-shape flags ``fake-engine``, ``simulate`` and ``demo`` share by name."""

    @property
    def block_size(self) -> int: ...
    @property
    def gpu_blocks(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def prefill_ms_per_token(self) -> float: ...
    @property
    def decode_ms_per_token(self) -> float: ...
    @property
    def prefill_base_ms(self) -> float: ...


@dataclass(frozen=True, slots=True)
class EngineParams:
    """Shape of one simulated replica (the ``fake-engine --mode simulated`` flags)."""

    block_size: int = 16
    num_blocks: int = 2048  # cache capacity in blocks (0 = unbounded)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN
    decode_ms_per_token: float = DEFAULT_DECODE_MS_PER_TOKEN
    prefill_base_ms: float = DEFAULT_PREFILL_BASE_MS  # per-request fixed cost of a prefill

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_blocks < 0:
            raise ValueError("num_blocks must not be negative")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        for name in ("prefill_ms_per_token", "decode_ms_per_token", "prefill_base_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    @classmethod
    def from_flags(cls, f: EngineFlags) -> EngineParams:
        """The model parameters a command's engine flags describe (ValueError when invalid)."""
        return cls(
            block_size=f.block_size,
            num_blocks=f.gpu_blocks,
            max_num_seqs=f.max_num_seqs,
            prefill_ms_per_token=f.prefill_ms_per_token,
            decode_ms_per_token=f.decode_ms_per_token,
            prefill_base_ms=f.prefill_base_ms,
        )


@dataclass(slots=True)
class Waiting(Generic[K]):
    key: K
    tokens: Sequence[int]
    adapter: str
    max_tokens: int
    arrival: float
    hashes: Sequence[int] | None = None


@dataclass(slots=True)
class Admitted(Generic[K]):
    """One sequence the engine just scheduled, with the times its model predicts."""

    key: K
    adapter: str
    prompt_tokens: int
    hit_tokens: int  # prefix-cache hit, as vLLM counts it (block aligned, capped)
    admitted_at: float
    first_token_at: float
    finish_at: float
    inserted: Inserted


@dataclass(slots=True)
class EngineCounters:
    """vLLM's prefix-cache counters (tokens) and request totals."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    evicted_blocks: int = 0
    stored_blocks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class EngineModel(Generic[K]):
    """Cache + slots + FIFO prefill lane of one replica; the caller owns the clock.

    ``submit`` queues a request, ``schedule(now)`` admits what fits and returns the admissions
    (the caller publishes their cache events and waits until ``first_token_at``/``finish_at``),
    ``finish`` frees a slot. ``on_admit`` (optional) sees every admission as it happens.
    """

    def __init__(
        self,
        params: EngineParams,
        *,
        cache: SimCache | None = None,
        on_admit: Callable[[Admitted[K]], None] | None = None,
    ) -> None:
        self.params = params
        self.cache = cache if cache is not None else SimCache(params.block_size, params.num_blocks)
        self.waiting: deque[Waiting[K]] = deque()
        self.running = 0
        self.busy_until = 0.0
        self.counters = EngineCounters()
        self.on_admit = on_admit
        self._prefill_s = params.prefill_ms_per_token / 1000.0
        self._base_s = params.prefill_base_ms / 1000.0
        self._decode_s = params.decode_ms_per_token / 1000.0

    @property
    def block_size(self) -> int:
        return self.params.block_size

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def load(self) -> int:
        """Running plus waiting sequences (what the subscriber turns into pressure)."""
        return self.running + len(self.waiting)

    def usage(self) -> float:
        """KV-cache usage in [0, 1] (vLLM's ``kv_cache_usage_perc``)."""
        return self.cache.usage()

    def check(self, tokens: Sequence[int]) -> None:
        """Reject what the engine could never serve (ValueError)."""
        if not tokens:
            raise ValueError("the prompt is empty")
        cap = self.params.num_blocks
        if cap and len(tokens) // self.params.block_size > cap:
            raise ValueError(
                f"the prompt needs {len(tokens) // self.params.block_size} blocks, "
                f"more than the cache's {cap}"
            )

    def submit(
        self,
        key: K,
        tokens: Sequence[int],
        adapter: str,
        max_tokens: int,
        now: float,
        hashes: Sequence[int] | None = None,
    ) -> None:
        """Queue one request (FIFO)."""
        self.check(tokens)
        self.waiting.append(Waiting(key, tokens, adapter, max(1, max_tokens), now, hashes))

    def schedule(self, now: float) -> list[Admitted[K]]:
        """Admit waiting requests while slots are free; returns the admissions in order."""
        out: list[Admitted[K]] = []
        limit = self.params.max_num_seqs
        while self.waiting and self.running < limit:
            w = self.waiting.popleft()
            out.append(self._admit(w, now))
        return out

    def _admit(self, w: Waiting[K], now: float) -> Admitted[K]:
        bs = self.params.block_size
        inserted = self.cache.insert(w.tokens, w.adapter, w.hashes)
        n = len(w.tokens)
        hit_tokens = min(inserted.hit_blocks, SimCache.hit_cap(n, bs)) * bs
        c = self.counters
        c.queries += n
        c.hits += hit_tokens
        c.requests += 1
        c.stored_blocks += len(inserted.stored)
        c.evicted_blocks += len(inserted.evicted)
        start = now if now > self.busy_until else self.busy_until
        first = start + self._base_s + (n - hit_tokens) * self._prefill_s
        self.busy_until = first
        finish = first + (w.max_tokens - 1) * self._decode_s
        self.running += 1
        adm = Admitted(w.key, w.adapter, n, hit_tokens, now, first, finish, inserted)
        if self.on_admit is not None:
            self.on_admit(adm)
        return adm

    def finish(self) -> None:
        """A sequence ended: free its slot (call ``schedule`` next)."""
        if self.running > 0:
            self.running -= 1

    def cancel(self, key: K) -> bool:
        """Drop a request that is still waiting (client went away)."""
        for i, w in enumerate(self.waiting):
            if w.key is key:
                del self.waiting[i]
                return True
        return False

    def reset_cache(self) -> None:
        """``/reset_prefix_cache``: forget every block (running sequences keep going)."""
        self.cache.clear()
