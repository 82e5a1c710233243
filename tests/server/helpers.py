"""Builders and bounded waits shared by the server, client and contract tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from inferencecache import fingerprint
from inferencecache.index.tenant_config import IndexConfig, TenantPolicy
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

TENANT = "t"
MODEL = "m"
SCHEME = "vllm"

# contract-and-index.md §10 preamble: floors off, affinity off (one replica in scope unless a test
# adds more).
PERMISSIVE = TenantPolicy(minimum_matched_tokens=0, routing_floor_score=0.0, affinity_routing=False)
CONFIG = IndexConfig(policies={TENANT: PERMISSIVE})

T = TypeVar("T")


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def chain_entry(
    toks: Sequence[int], block: int = 16, tier: int = 1, adapter: str = ""
) -> pb.PrefixEntry:
    hashes, counts = fingerprint.chain(list(toks), block)
    return pb.PrefixEntry(
        block_hashes=hashes,
        block_token_counts=counts,
        tier=tier,  # type: ignore[arg-type]
        adapter_id=adapter,
    )


def update(
    replica: str,
    entries: Sequence[pb.PrefixEntry] = (),
    *,
    tenant: str = TENANT,
    model: str = MODEL,
    scheme: str = SCHEME,
    stats: pb.ReplicaStats | None = None,
    timestamp_us: int = 0,
) -> pb.CacheStateUpdate:
    msg = pb.CacheStateUpdate(
        replica_id=replica,
        model_id=model,
        tenant_id=tenant,
        hash_scheme=scheme,
        prefixes=list(entries),
        timestamp_us=timestamp_us,
    )
    if stats is not None:
        msg.stats.CopyFrom(stats)
    return msg


def lookup_chain(
    toks: Sequence[int],
    *,
    tenant: str = TENANT,
    model: str = MODEL,
    scheme: str = SCHEME,
    block: int = 16,
    adapter: str = "",
) -> pb.LookupRouteRequest:
    hashes, counts = fingerprint.chain(list(toks), block)
    return pb.LookupRouteRequest(
        tenant_id=tenant,
        model_id=model,
        hash_scheme=scheme,
        block_hashes=hashes,
        block_token_counts=counts,
        adapter_id=adapter,
    )


def lookup_tokens(
    toks: Sequence[int], *, tenant: str = TENANT, model: str = MODEL, scheme: str = SCHEME
) -> pb.LookupRouteRequest:
    return pb.LookupRouteRequest(
        tenant_id=tenant, model_id=model, hash_scheme=scheme, token_ids=list(toks)
    )


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.01) -> T:
    """Poll until ``predicate()`` is truthy (bounded); returns its value or fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def one_shot(*msgs: pb.CacheStateUpdate) -> Iterator[pb.CacheStateUpdate]:
    yield from msgs
