"""The LookupRoute pipeline (contract §5.1-§5.3, §5.8-§5.12): ``Router.lookup``.

Order of the steps is the contract's, first exit wins. Inputs are resolved outside the index
lock (fingerprinting token ids, tokenizing prompt_text on a worker thread with a wait bounded
by the deadline); the index part (orchestration, gates, affinity, LFU credit) runs under the
lock so it sees one consistent index state.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from inferencecache import fingerprint
from inferencecache.index.facade import Index
from inferencecache.index.ingest import wrap32
from inferencecache.index.lookup import match_chain, match_exact
from inferencecache.index.model import (
    MAX_TOKENS,
    PROBE_TENANT,
    LookupRequest,
    LookupResult,
    Reason,
    ReplicaScore,
)
from inferencecache.index.policy import EffectivePolicy
from inferencecache.index.ranking import (
    Row,
    affinity_pick,
    chain_seed,
    classify,
    slo_coeff,
    tenant_hot,
)
from inferencecache.index.settings import PROMPT_DEADLINE_S, TOKENIZE_SLOTS
from inferencecache.index.state import IndexState, Partition


class PromptTokenizer(Protocol):
    """Server-side tokenization of ``prompt_text`` (contract §5.2 step 4). Blocking calls."""

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
    """LookupRoute over an ``Index``; thread-safe (call ``lookup`` from any thread)."""

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
        """One LookupRoute (§5.1). Never raises for any well-typed request."""
        index = self._index
        clock = index.clock
        start = clock.monotonic()
        tenant = req.tenant_id
        # 1. probe tenant
        if tenant == PROBE_TENANT:
            return LookupResult(Reason.NO_HINT)
        st = index._state
        pol = st.policies.get(tenant)
        settings = index.settings

        bh = req.block_hashes
        if req.packed_hashes and isinstance(bh, bytes):
            n_hashes = len(bh) >> 3 if not len(bh) & 7 else -1
        else:
            n_hashes = len(bh)
        counts_wire = req.block_token_counts
        n_counts = len(counts_wire)
        chain_set = n_hashes != 0 or n_counts != 0
        chain_unequal = n_hashes != n_counts
        token_ids = req.token_ids
        has_tokens = len(token_ids) > 0
        chain_on = pol.enable_chain_matching

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
            and not req.prefix_hash
            and not has_tokens
            and (not chain_set or not chain_on)
        ):
            deadline = start + PROMPT_DEADLINE_S
        # 3. deadline already passed
        if deadline is not None and start >= deadline:
            return self._envelope(Reason.TIMEOUT, start)
        # 4. require_chain looks at the wire request only
        if pol.require_chain and (n_hashes <= 0 or chain_unequal):
            return self._envelope(Reason.POLICY_REQUIRES_CHAIN, start)

        # 5. resolve inputs (§5.2)
        keys: Sequence[bytes] | bytes | None = None
        counts: Sequence[int] = ()
        exact_hash = b""
        exact_count = 0
        effective: int | None = None
        echo: Sequence[int] = _NO_TOKENS
        status = _OK
        block = settings.engine_block_size
        prefix_hash = req.prefix_hash
        resolved = False
        ignored_chain = False
        if not chain_on:
            if prefix_hash:
                exact_hash = prefix_hash
                exact_count = req.prefix_token_count
                resolved = True
            else:
                ignored_chain = chain_set
        elif chain_set or prefix_hash:
            resolved = True
            if chain_unequal or n_hashes > settings.max_blocks_per_entry:
                status = _FAIL
            else:
                if n_hashes > 0:
                    keys = bh
                    counts = counts_wire
                exact_hash = prefix_hash
                exact_count = req.prefix_token_count
        if not resolved:
            packed: bytes | None = None
            if has_tokens:
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
            elif ignored_chain:
                status = _FAIL
            else:
                exact_count = req.prefix_token_count  # the empty-prefix_hash quirk (§5.2 step 5)
            if packed:
                n_blocks = len(packed) >> 3
                exact_hash = packed[-8:]
                exact_count = wrap32(block * n_blocks)
                effective = exact_count
                if chain_on:
                    keys = packed
                    counts = [block] * n_blocks
        if status == _TIMEOUT:
            return self._envelope(Reason.TIMEOUT, start, echo)
        if deadline is not None and clock.monotonic() >= deadline:
            return self._envelope(Reason.TIMEOUT, start, echo)
        # 6. resolution fail-open
        if status == _FAIL:
            return self._envelope(Reason.NO_HINT, start, echo)
        # 7. minimum_prefix_tokens short-circuit (affinity off). effective_prefix_tokens is
        # only needed when the floor is set (summing 512 counts costs ~3 µs).
        min_prefix = pol.minimum_prefix_tokens
        if min_prefix > 0:
            if effective is None:
                effective = wrap32(sum(counts)) if keys is not None else wrap32(exact_count)
            if effective < min_prefix and not pol.affinity_routing:
                return self._envelope(Reason.NO_HINT, start, echo)
        else:
            effective = 0
        # 8. chain matching off: the resolution above never produced a chain.

        # 9.-11. the index part, under the lock
        model = req.model_id
        scheme = req.hash_scheme
        adapter = req.adapter_id
        slo = slo_coeff(settings, req.ttft_ms)
        with index._lock:
            t0 = clock.monotonic() if deadline is not None else 0.0
            now_us = clock.now_us()
            strategy, rows, part = _orchestrate(
                st, pol, tenant, model, scheme, adapter, keys, counts, exact_hash, now_us, slo
            )
            if deadline is not None:
                t1 = clock.monotonic()
                if t1 >= deadline or (timeout_ms > 0 and (t1 - t0) * 1000.0 > timeout_ms):
                    return self._envelope(Reason.TIMEOUT, start, echo)
            # 10. TENANT_HOT switched off
            if strategy == Reason.TENANT_HOT and not pol.enable_tenant_hot:
                strategy = None
            # 11. gates G0-G2 (§5.8)
            if (
                min_prefix > 0
                and (strategy == Reason.PREFIX_MATCH or strategy == Reason.TENANT_HOT)
                and effective is not None
                and effective < min_prefix
            ):
                strategy = None  # G0
            if strategy == Reason.PREFIX_MATCH:
                floor = pol.minimum_matched_tokens
                if floor > 0:
                    rows = [r for r in rows if r.matched >= floor]
                    if not rows:
                        strategy = None
                score_floor = pol.routing_floor_score
                if strategy is not None and score_floor > 0 and rows[0].score < score_floor:
                    strategy = None
            if strategy is None:
                # affinity (§5.9)
                reason = Reason.NO_HINT
                scores: list[ReplicaScore] = []
                if pol.affinity_routing and tenant and model and scheme and not chain_unequal:
                    seed = chain_seed(keys) if keys is not None else exact_hash
                    serving = st.serving.get((tenant, model, scheme)) if seed else None
                    if serving:
                        names = st.replicas.names
                        replicas = sorted(names[r] or "" for r in serving)
                        scores = [ReplicaScore(affinity_pick(seed, replicas))]
                        reason = Reason.AFFINITY_HINT
                return self._post(reason, start, scores, echo, adapter)
            if strategy == Reason.PREFIX_MATCH or strategy == Reason.TENANT_HOT:
                if strategy == Reason.PREFIX_MATCH and pol.lfu and part is not None:
                    st.cap_pool = None  # credits reorder LFU holds (eviction.CapPool)
                    _credit(part, rows, keys, exact_hash)
                scores = [
                    ReplicaScore(r.replica_id, r.score, r.matched, r.prob, r.tier) for r in rows
                ]
                return self._post(strategy, start, scores, echo, adapter)
            return self._post(strategy, start, [], echo, adapter)  # UNKNOWN_*

    # -- helpers --------------------------------------------------------------------------

    def _latency(self, start: float) -> int:
        return max(0, int((self._index.clock.monotonic() - start) * 1_000_000))

    def _envelope(
        self, reason: str, start: float, echo: Sequence[int] = _NO_TOKENS
    ) -> LookupResult:
        """A pre-index response: no scores, no adapter echo."""
        return LookupResult(reason, [], self._latency(start), echo, "")

    def _post(
        self,
        reason: str,
        start: float,
        scores: list[ReplicaScore],
        echo: Sequence[int],
        adapter: str,
    ) -> LookupResult:
        """A response produced after orchestration: echoes the request's adapter_id."""
        return LookupResult(reason, scores, self._latency(start), echo, adapter)

    def _fingerprint_tokens(self, req: LookupRequest, block: int) -> bytes | None:
        """Packed chain of ``token_ids`` (§5.2 step 3); None = fail-open."""
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
        """§5.2 step 4: (status, tokens). Tokens are returned only on success."""
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


def _orchestrate(
    st: IndexState,
    pol: EffectivePolicy,
    tenant: str,
    model: str,
    scheme: str,
    adapter: str,
    keys: Sequence[bytes] | bytes | None,
    counts: Sequence[int],
    exact_hash: bytes,
    now_us: int,
    slo: float,
) -> tuple[str | None, list[Row], Partition | None]:
    """§5.3: (strategy or None for StrategyNone, ranked rows, the matched partition)."""
    if not tenant or not model or not scheme:
        return None, [], None
    part = st.parts.get((tenant, model, scheme, adapter))
    settings = st.settings
    if keys is not None:
        if part is not None:
            rows = match_chain(st, settings, part, keys, counts, pol.ttl_us, now_us, slo)
            if rows:
                return Reason.PREFIX_MATCH, rows, part
        return classify(st, tenant, model, scheme), [], None
    if part is not None:
        rows = match_exact(st, settings, part, exact_hash, pol.ttl_us, now_us, slo)
        if rows:
            return Reason.PREFIX_MATCH, rows, part
    hot = tenant_hot(st, settings, tenant, model, scheme, now_us, slo)
    if hot:
        return Reason.TENANT_HOT, hot, None
    return classify(st, tenant, model, scheme), [], None


def _credit(
    part: Partition, rows: list[Row], keys: Sequence[bytes] | bytes | None, exact_hash: bytes
) -> None:
    """§5.10: +1 access on every contributing hold of every returned replica."""
    store = part.store
    for r in rows:
        if r.blocks <= 0:
            continue
        if keys is not None:
            store.credit(keys, r.blocks, r.rid)
        else:
            store.credit((exact_hash,), 1, r.rid)
