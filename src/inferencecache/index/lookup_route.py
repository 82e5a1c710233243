"""The LookupRoute pipeline (contract-and-index.md §5.1-§5.3, §5.8-§5.12): ``Router.lookup``.

Order of the steps is the contract's, first exit wins. Inputs are resolved outside the index
lock (fingerprinting token ids, tokenizing prompt_text on a worker thread with a wait bounded
by the deadline); the index part (orchestration, gates, affinity, LFU credit) runs under the
lock so it sees one consistent index state.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from inferencecache import accelerators, fingerprint
from inferencecache.index.apply import wrap32
from inferencecache.index.clock import SystemClock
from inferencecache.index.facade import Index
from inferencecache.index.model import (
    MAX_TOKENS,
    PROBE_TENANT,
    LookupRequest,
    LookupResult,
    Reason,
    ReplicaScore,
)
from inferencecache.index.orchestrate import credit as lfu_credit
from inferencecache.index.orchestrate import orchestrate
from inferencecache.index.ranking import RankerCache, Rankers, affinity_pick, chain_seed
from inferencecache.index.settings import PROMPT_DEADLINE_S, TOKENIZE_SLOTS
from inferencecache.index.state import IndexState
from inferencecache.index.tenant_config import EffectivePolicy


class PromptTokenizer(Protocol):
    """Server-side tokenization of ``prompt_text`` (contract-and-index.md §5.2 step 4). Blocking
    calls."""

    def has_model(self, model_id: str) -> bool:
        """Whether a tokenizer for ``model_id`` is loaded."""
        ...

    def encode_chat(self, model_id: str, text: str) -> list[int]:
        """Token ids of the model's chat template applied to exactly one
        ``{"role": "user", "content": text}`` message with the generation prompt appended."""
        ...


_OK = 0
_FAIL = 1
_TIMEOUT = 2
_NO_TOKENS: Sequence[int] = ()
_PREFIX_MATCH = Reason.PREFIX_MATCH
_TENANT_HOT = Reason.TENANT_HOT
_NO_HINT = Reason.NO_HINT
_TIMEOUT_R = Reason.TIMEOUT
_time_ns = time.time_ns  # SystemClock.now_us() == _time_ns() // 1000, without the Python call

Resolved = tuple[
    Sequence[bytes] | bytes | None, Sequence[int], bytes, float | None, int, int, int | None,
    Sequence[int], bool,
]  # fmt: skip
"""What ``Router._prelude`` resolves for the index part: (keys, counts, exact hash, deadline,
policy timeout ms, minimum prefix tokens, effective prefix tokens, echo, chain lengths
unequal)."""


def _utf8_len_over(text: str, limit: int) -> bool:
    """Whether ``text`` is longer than ``limit`` UTF-8 bytes, encoding only when in doubt."""
    n = len(text)
    if n > limit:
        return True
    if n * 4 <= limit:
        return False
    try:
        return len(text.encode("utf-8")) > limit
    except UnicodeEncodeError:
        return True


def _varints_truncating(buf: bytes) -> list[int]:
    """Packed uint32 varints decoded the way protobuf does (values above 32 bits truncate)."""
    out: list[int] = []
    value = shift = 0
    for byte in buf:
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            out.append(value & 0xFFFF_FFFF)
            value = shift = 0
        else:
            shift += 7
            if shift > 63:
                raise ValueError("varint longer than 10 bytes")
    if shift:
        raise ValueError("truncated varint")
    return out


class Router:
    """LookupRoute over an ``Index``; thread-safe (call ``lookup`` from any thread).

    The index's clock and settings are read once here (they never change for an ``Index``), so
    a lookup does not walk attribute chains for them; the index part runs through
    ``Index.run_locked``. The scoring step of each tenant policy is built once
    (``ranking.RankerCache``), not per lookup.
    """

    def __init__(
        self,
        index: Index,
        *,
        tokenizer: PromptTokenizer | None = None,
        tokenize_slots: int = TOKENIZE_SLOTS,
    ) -> None:
        self._index = index
        self._tokenizer = tokenizer
        self._slots = threading.BoundedSemaphore(tokenize_slots)
        self._slot_count = tokenize_slots
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        settings = index.settings
        clock = index.clock
        # SystemClock.monotonic is time.monotonic behind a Python call; skip that call
        self._mono = time.monotonic if type(clock) is SystemClock else clock.monotonic
        self._now_us = clock.now_us
        self._sysclock = type(clock) is SystemClock
        self._settings = settings
        self._max_blocks = settings.max_blocks_per_entry
        self._names = index.run_locked(_replica_names)
        self._rankers_of = RankerCache(self._names, settings).get
        # bound once: the lookup path calls these on every request
        self._policy = index.policy
        self._run_locked = index.run_locked
        self._uniform_counts: dict[int, Sequence[int]] = {}

    @property
    def index(self) -> Index:
        return self._index

    def close(self) -> None:
        """Stop the tokenizer workers (abandoned tokenizations finish in the background)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- the pipeline ---------------------------------------------------------------------

    def lookup(self, req: LookupRequest) -> LookupResult:
        """One LookupRoute (contract-and-index.md §5.1). Never raises for any well-typed request."""
        start = self._mono()
        tenant = req.tenant_id
        # 1. probe tenant
        if tenant == PROBE_TENANT:
            return LookupResult(_NO_HINT)
        pol = self._policy(tenant)
        bh = req.block_hashes
        if (
            pol.plain_chain
            and req.packed_hashes
            and type(bh) is bytes
            and req.deadline is None
            and not len(bh) & 7
            and 0 < len(bh) >> 3 <= self._max_blocks
            and len(bh) >> 3 == len(req.block_token_counts)
        ):
            # The usual gateway request: a well-formed packed chain under a policy without
            # deadline, require_chain or minimum_prefix_tokens. Steps 2-8 would decide exactly
            # this (no deadline, the chain resolves as given, nothing to gate).
            resolved: Resolved = (
                bh, req.block_token_counts, req.prefix_hash, None, 0, 0, None, _NO_TOKENS, False,
            )  # fmt: skip
        else:
            early = self._prelude(req, pol, start)
            if isinstance(early, LookupResult):
                return early  # an early exit of steps 2-7
            resolved = early
        return self._run_locked(
            self._decide, req, pol, self._rankers_of(pol), resolved, start
        )

    def _decide(
        self,
        st: IndexState,
        req: LookupRequest,
        pol: EffectivePolicy,
        rankers: Rankers,
        resolved: Resolved,
        start: float,
    ) -> LookupResult:
        """Steps 9-11 of contract-and-index.md §5.1 under the index lock: orchestration, the
        deadline check, the gates, LFU credit and affinity (contract-and-index.md §5.8-§5.10)."""
        (
            keys, counts, exact_hash, deadline, timeout_ms, min_prefix, effective, echo,
            chain_unequal,
        ) = resolved  # fmt: skip
        mono = self._mono
        tenant = req.tenant_id
        model = req.model_id
        scheme = req.hash_scheme
        adapter = req.adapter_id
        t0 = mono() if deadline is not None else 0.0
        now_us = _time_ns() // 1000 if self._sysclock else self._now_us()
        strategy, scores, credit, part = orchestrate(
            st, rankers, self._settings, (tenant, model, scheme, adapter), keys, counts,
            exact_hash, now_us, req.ttft_ms,
        )  # fmt: skip
        if deadline is not None:
            t1 = mono()
            if t1 >= deadline or (timeout_ms > 0 and (t1 - t0) * 1000.0 > timeout_ms):
                return self._envelope(_TIMEOUT_R, start, echo)
        if strategy is _PREFIX_MATCH:
            # 11. gates (contract-and-index.md §5.8): G0; G1 already applied by the ranker; G2
            if min_prefix > 0 and effective is not None and effective < min_prefix:
                strategy = None
            elif not scores:
                strategy = None  # G1 left nothing
            else:
                floor = pol.routing_floor_score
                if floor > 0 and scores[0].score < floor:
                    strategy = None
            if strategy is not None:
                if credit and part is not None:
                    st.cap_pool = None  # credits reorder LFU holds (eviction.CapPool)
                    lfu_credit(part, credit, keys, exact_hash)
                return LookupResult(strategy, scores, _micros(mono() - start), echo, adapter)
        elif strategy is _TENANT_HOT:
            # 10. TENANT_HOT switched off; G0
            if not pol.enable_tenant_hot or (
                min_prefix > 0 and effective is not None and effective < min_prefix
            ):
                strategy = None
            else:
                return LookupResult(strategy, scores, _micros(mono() - start), echo, adapter)
        if strategy is None:
            # affinity (contract-and-index.md §5.9)
            reason = _NO_HINT
            scores = []
            if pol.affinity_routing and tenant and model and scheme and not chain_unequal:
                seed = chain_seed(keys) if keys is not None else exact_hash
                serving = st.serving.get((tenant, model, scheme)) if seed else None
                if serving:
                    names = self._names
                    replicas = sorted(names[r] or "" for r in serving)
                    scores = [ReplicaScore(affinity_pick(seed, replicas))]
                    reason = Reason.AFFINITY_HINT
            return self._post(reason, start, scores, echo, adapter)
        return self._post(strategy, start, [], echo, adapter)  # UNKNOWN_*

    def _prelude(
        self, req: LookupRequest, pol: EffectivePolicy, start: float
    ) -> Resolved | LookupResult:
        """contract-and-index.md §5.1 steps 2-8: an early response, or the resolved inputs of the
        index part."""
        bh = req.block_hashes
        counts_wire = req.block_token_counts
        mono = self._mono
        if req.packed_hashes and isinstance(bh, bytes):
            n_hashes = len(bh) >> 3 if not len(bh) & 7 else -1
        else:
            n_hashes = len(bh)
        n_counts = len(counts_wire)
        chain_set = n_hashes != 0 or n_counts != 0
        chain_unequal = n_hashes != n_counts
        chain_on = pol.enable_chain_matching
        prefix_hash = req.prefix_hash

        # 2. deadline
        deadline = req.deadline
        timeout_ms = pol.lookup_timeout_ms
        if timeout_ms > 0:
            d = start + timeout_ms / 1000.0
            if deadline is None or d < deadline:
                deadline = d
        if (
            deadline is None
            and req.prompt_text
            and not prefix_hash
            and not len(req.token_ids)
            and (not chain_set or not chain_on)
        ):
            deadline = start + PROMPT_DEADLINE_S
        # 3. deadline already passed
        if deadline is not None and start >= deadline:
            return self._envelope(_TIMEOUT_R, start)
        # 4. require_chain looks at the wire request only
        if pol.require_chain and (n_hashes <= 0 or chain_unequal):
            return self._envelope(Reason.POLICY_REQUIRES_CHAIN, start)

        # 5. resolve inputs (contract-and-index.md §5.2)
        keys: Sequence[bytes] | bytes | None = None
        counts: Sequence[int] = ()
        exact_hash = b""
        exact_count = 0
        effective: int | None = None
        echo: Sequence[int] = _NO_TOKENS
        status = _OK
        if chain_on and chain_set:  # the usual gateway request: a chain
            if chain_unequal or n_hashes > self._max_blocks:
                status = _FAIL
            else:
                if n_hashes > 0:
                    keys = bh
                    counts = counts_wire
                exact_hash = prefix_hash
                exact_count = req.prefix_token_count
        elif prefix_hash:
            exact_hash = prefix_hash
            exact_count = req.prefix_token_count
        else:
            status, keys, counts, exact_hash, exact_count, effective, echo = self._resolve(
                req, chain_on, chain_set, deadline
            )
        if status != _OK:
            if status == _TIMEOUT:
                return self._envelope(_TIMEOUT_R, start, echo)
            if deadline is not None and mono() >= deadline:
                return self._envelope(_TIMEOUT_R, start, echo)
            # 6. resolution fail-open
            return self._envelope(_NO_HINT, start, echo)
        if deadline is not None and mono() >= deadline:
            return self._envelope(_TIMEOUT_R, start, echo)
        # 7. minimum_prefix_tokens short-circuit (affinity off). effective_prefix_tokens is
        # only needed when the floor is set (summing 512 counts costs ~3 µs).
        min_prefix = pol.minimum_prefix_tokens
        if min_prefix > 0:
            if effective is None:
                effective = wrap32(sum(counts)) if keys is not None else wrap32(exact_count)
            if effective < min_prefix and not pol.affinity_routing:
                return self._envelope(_NO_HINT, start, echo)
        # 8. chain matching off: the resolution above never produced a chain.
        return (
            keys, counts, exact_hash, deadline, timeout_ms, min_prefix, effective, echo,
            chain_unequal,
        )  # fmt: skip

    def _resolve(
        self, req: LookupRequest, chain_on: bool, chain_set: bool, deadline: float | None
    ) -> tuple[
        int, Sequence[bytes] | bytes | None, Sequence[int], bytes, int, int | None, Sequence[int]
    ]:
        """contract-and-index.md §5.2 steps 3-5 (no prefix_hash, and no chain or chain matching
        off): (status, keys, counts, exact hash, exact count, effective tokens or None, echo)."""
        block = self._settings.engine_block_size
        packed: bytes | None = None
        status = _OK
        echo: Sequence[int] = _NO_TOKENS
        if len(req.token_ids) > 0:
            packed = self._fingerprint_tokens(req, block)
            if packed is None:
                status = _FAIL
        elif req.prompt_text:
            status, echo = self._tokenize(req.model_id, req.prompt_text, deadline)
            if status == _OK:
                try:
                    packed = fingerprint.chain_packed(echo, block)
                except (ValueError, TypeError, OverflowError):
                    status, echo = _FAIL, _NO_TOKENS
                else:
                    if not packed:
                        status = _FAIL  # sub-block prompt: fail-open *with* echo
        elif chain_set:  # chain fields with chain matching off
            status = _FAIL
        else:
            # the empty-prefix_hash quirk (contract-and-index.md §5.2 step 5)
            return _OK, None, (), b"", req.prefix_token_count, None, echo
        if not packed:
            return status, None, (), b"", 0, None, echo
        n_blocks = len(packed) >> 3
        exact_count = wrap32(block * n_blocks)
        if not chain_on:
            return status, None, (), packed[-8:], exact_count, exact_count, echo
        return (
            status, packed, self._uniform(block, n_blocks), packed[-8:], exact_count,
            exact_count, echo,
        )  # fmt: skip

    def _uniform(self, block: int, n: int) -> Sequence[int]:
        """``[block] * n`` as a packed, cached sequence (the walk reads it without a list of
        Python ints): bytes when the block size fits one byte, else an ``array('i')``."""
        counts = self._uniform_counts.get(n)
        if counts is None:
            counts = bytes((block,)) * n if block < 256 else array("i", (block,)) * n
            if len(self._uniform_counts) >= 4096:
                self._uniform_counts.clear()
            self._uniform_counts[n] = counts
        return counts

    # -- helpers --------------------------------------------------------------------------

    def _envelope(
        self, reason: str, start: float, echo: Sequence[int] = _NO_TOKENS
    ) -> LookupResult:
        """A pre-index response: no scores, no adapter echo."""
        return LookupResult(reason, [], _micros(self._mono() - start), echo, "")

    def _post(
        self,
        reason: str,
        start: float,
        scores: list[ReplicaScore],
        echo: Sequence[int],
        adapter: str,
    ) -> LookupResult:
        """A response produced after orchestration: echoes the request's adapter_id."""
        return LookupResult(reason, scores, _micros(self._mono() - start), echo, adapter)

    def _fingerprint_tokens(self, req: LookupRequest, block: int) -> bytes | None:
        """Packed chain of ``token_ids`` (contract-and-index.md §5.2 step 3); None = fail-open."""
        tokens = req.token_ids
        try:
            if req.token_varints and isinstance(tokens, bytes | bytearray | memoryview):
                buf = bytes(tokens)
                if fingerprint.varint_count(buf) > MAX_TOKENS:
                    return None
                try:
                    packed = fingerprint.chain_from_varints(buf, block)
                except ValueError:
                    # protobuf truncates uint32 values above 32 bits; decode the same way
                    accelerators.fell_back("token_varints")
                    packed = fingerprint.chain_packed(_varints_truncating(buf), block)
            else:
                if len(tokens) > MAX_TOKENS:
                    return None
                packed = fingerprint.chain_packed(tokens, block)
        except (ValueError, TypeError, OverflowError):
            return None
        return packed or None

    def _executor(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._pool_lock:
                pool = self._pool
                if pool is None:
                    pool = self._pool = ThreadPoolExecutor(
                        max_workers=self._slot_count, thread_name_prefix="tokenize"
                    )
        return pool

    def _run_tokenizer(self, tokenizer: PromptTokenizer, model: str, text: str) -> list[int]:
        try:
            return list(tokenizer.encode_chat(model, text))
        finally:
            self._slots.release()

    def _tokenize(self, model: str, text: str, deadline: float | None) -> tuple[int, Sequence[int]]:
        """contract-and-index.md §5.2 step 4: (status, tokens). Tokens are returned only on
        success."""
        tokenizer = self._tokenizer
        if tokenizer is None or _utf8_len_over(text, MAX_TOKENS):
            return _FAIL, _NO_TOKENS
        try:
            if not tokenizer.has_model(model):
                return _FAIL, _NO_TOKENS
        except Exception:
            return _FAIL, _NO_TOKENS
        if not self._slots.acquire(blocking=False):
            return _FAIL, _NO_TOKENS
        try:
            future = self._executor().submit(self._run_tokenizer, tokenizer, model, text)
        except RuntimeError:
            self._slots.release()
            return _FAIL, _NO_TOKENS
        clock = self._index.clock
        if deadline is None:
            deadline = clock.monotonic() + PROMPT_DEADLINE_S
        if not clock.wait(future, deadline - clock.monotonic()):
            return _TIMEOUT, _NO_TOKENS
        if future.exception() is not None:
            return _FAIL, _NO_TOKENS
        ids = future.result()
        if not ids or len(ids) > MAX_TOKENS:
            return _FAIL, _NO_TOKENS
        return _OK, ids


def _micros(seconds: float) -> int:
    return max(0, int(seconds * 1_000_000))


def _replica_names(st: IndexState) -> list[str | None]:
    """The index's replica id -> name list (the same list object for the index's life)."""
    return st.replicas.names
