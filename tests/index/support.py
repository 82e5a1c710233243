"""Helpers of the index suite: an index + router on a fake clock with terse ingest/lookup."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

from inferencecache.index import (
    Event,
    FakeClock,
    Index,
    IndexConfig,
    IndexSettings,
    LookupRequest,
    LookupResult,
    Prefix,
    PromptTokenizer,
    RecordingMetrics,
    Router,
    Stats,
    TenantPolicy,
    TenantQuota,
    Update,
)
from inferencecache.index.store import PartitionStore

T = "t"
M = "m"
S = "vllm"
MIN = 60.0
TTL = 30 * MIN

TEST_POLICY = TenantPolicy(
    minimum_matched_tokens=0, routing_floor_score=0.0, affinity_routing=False
)
"""contract-and-index.md §10's default test policy: G1 and G2 off, affinity off."""


def h(i: int, tag: int = 0xAB) -> bytes:
    """A distinct 8-byte block hash."""
    return bytes([tag]) + i.to_bytes(7, "big")


def ids(res: LookupResult) -> list[str]:
    return [s.replica_id for s in res.replica_scores]


class Env:
    """An index + router on a fake clock with terse helpers; tenant ``t`` gets TEST_POLICY
    unless ``defaults=True`` or an explicit ``config`` is given."""

    def __init__(
        self,
        store_factory: Callable[[], PartitionStore],
        *,
        settings: IndexSettings | None = None,
        config: IndexConfig | None = None,
        defaults: bool = False,
        tokenizer: PromptTokenizer | None = None,
        clock: FakeClock | None = None,
    ) -> None:
        self.clock = clock if clock is not None else FakeClock()
        self.metrics = RecordingMetrics()
        if config is None:
            config = IndexConfig() if defaults else IndexConfig(policies={T: TEST_POLICY})
        self.index = Index(
            settings,
            clock=self.clock,
            store_factory=store_factory,
            metrics=self.metrics,
            config=config,
        )
        self.router = Router(self.index, tokenizer=tokenizer)

    @property
    def now(self) -> int:
        return self.clock.now_us()

    def ts(self, age: float = 0.0) -> int:
        """Timestamp ``age`` seconds in the past."""
        return self.now - round(age * 1_000_000)

    # -- ingest -----------------------------------------------------------------------------

    def update(self, replica: str, prefixes: Sequence[Prefix] = (), **kw: Any) -> None:
        kw.setdefault("tenant_id", T)
        kw.setdefault("model_id", M)
        kw.setdefault("hash_scheme", S)
        age = kw.pop("age", None)
        if age is not None:
            kw["timestamp_us"] = self.ts(age)
        self.index.apply_update(Update(replica_id=replica, prefixes=list(prefixes), **kw))

    def chain(
        self,
        replica: str,
        hashes: Sequence[bytes],
        counts: int | Sequence[int] = 16,
        *,
        tier: int = 0,
        entry_adapter: str = "",
        prefix_hash: bytes = b"",
        token_count: int = 0,
        **kw: Any,
    ) -> None:
        cs = [counts] * len(hashes) if isinstance(counts, int) else list(counts)
        p = Prefix(
            prefix_hash=prefix_hash,
            token_count=token_count,
            block_hashes=list(hashes),
            block_token_counts=cs,
            tier=tier,
            adapter_id=entry_adapter,
        )
        self.update(replica, [p], **kw)

    def legacy(
        self,
        replica: str,
        key: bytes,
        tokens: int,
        *,
        tier: int = 0,
        entry_adapter: str = "",
        **kw: Any,
    ) -> None:
        p = Prefix(prefix_hash=key, token_count=tokens, tier=tier, adapter_id=entry_adapter)
        self.update(replica, [p], **kw)

    def stats(
        self,
        replica: str,
        hit_rate: float = 0.0,
        pressure: float = 0.0,
        **kw: Any,
    ) -> None:
        extra = {
            k: kw.pop(k)
            for k in ("cache_memory_bytes", "t2_hit_tokens", "t2_query_tokens")
            if k in kw
        }
        self.update(replica, [], stats=Stats(hit_rate=hit_rate, pressure=pressure, **extra), **kw)

    def event(self, type_: int, replica: str, key: bytes = b"", **kw: Any) -> None:
        kw.setdefault("tenant_id", T)
        kw.setdefault("model_id", M)
        self.index.apply_event(Event(type=type_, replica_id=replica, prefix_hash=key, **kw))

    # -- lookup -----------------------------------------------------------------------------

    def lookup(
        self,
        hashes: Sequence[bytes] | None = None,
        counts: int | Sequence[int] = 16,
        **kw: Any,
    ) -> LookupResult:
        kw.setdefault("tenant_id", T)
        kw.setdefault("model_id", M)
        kw.setdefault("hash_scheme", S)
        if hashes is not None:
            kw["block_hashes"] = list(hashes)
            kw["block_token_counts"] = (
                [counts] * len(hashes) if isinstance(counts, int) else list(counts)
            )
        return self.router.lookup(LookupRequest(**kw))

    def exact(self, key: bytes, tokens: int = 0, **kw: Any) -> LookupResult:
        return self.lookup(prefix_hash=key, prefix_token_count=tokens, **kw)

    # -- config -----------------------------------------------------------------------------

    def policy(self, tenant: str = T, *, base: TenantPolicy = TEST_POLICY, **fields: Any) -> None:
        """Give ``tenant`` a policy (other tenants' entries are kept)."""
        cfg = self.index.config
        pols = dict(cfg.policies)
        pols[tenant] = _replace(base, **fields)
        self.index.replace_config(IndexConfig(policies=pols, quotas=cfg.quotas))

    def quota(self, tenant: str, n: int) -> None:
        cfg = self.index.config
        quotas = dict(cfg.quotas)
        quotas[tenant] = TenantQuota(max_index_entries=n)
        self.index.replace_config(IndexConfig(policies=cfg.policies, quotas=quotas))

    # -- inspection -------------------------------------------------------------------------

    def holds(self) -> dict[tuple[str, str, str, str, bytes, str], tuple[int, int, int, int]]:
        """(tenant, model, scheme, adapter, key, replica) -> (tokens, last_seen, tier, access)."""
        return {
            (*h.partition, h.key, h.replica_id): (h.tokens, h.last_seen_us, h.tier, h.access)
            for h in self.index.holds()
        }

    def access(self, replica: str, key: bytes, **kw: str) -> int:
        full = (kw.get("tenant", T), kw.get("model", M), kw.get("scheme", S), kw.get("adapter", ""))
        return self.holds()[(*full, key, replica)][3]

    def check(self) -> None:
        assert self.index.verify() == []

    def close(self) -> None:
        self.router.close()


_STRATEGY_FIELDS = ("enable_chain_matching", "require_chain", "enable_tenant_hot")


def _replace(base: TenantPolicy, **fields: Any) -> TenantPolicy:
    """``dataclasses.replace`` that also accepts the nested strategy fields flat."""
    strat = {k: fields.pop(k) for k in _STRATEGY_FIELDS if k in fields}
    if strat:
        fields["strategy"] = dataclasses.replace(base.strategy, **strat)
    return dataclasses.replace(base, **fields)


class FakeTokenizer:
    """A ``PromptTokenizer`` that records calls; ``fn(text)`` makes the ids (default: one id per
    character, so a 16-character prompt is one block)."""

    def __init__(
        self, models: Sequence[str] = ("m",), fn: Callable[[str], list[int]] | None = None
    ) -> None:
        self.models = set(models)
        self.fn = fn if fn is not None else (lambda text: [ord(c) for c in text])
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def has_model(self, model_id: str) -> bool:
        return model_id in self.models

    def encode_chat(self, model_id: str, text: str) -> list[int]:
        with self._lock:
            self.calls.append((model_id, text))
        return self.fn(text)


