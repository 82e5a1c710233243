"""ICB1 batches (``index/batch.py``): what an ingest log will hand every replica. The compiled
applier (``Index.apply_batch`` on the compiled store) and the reference reader and applier
(``batch.apply_reference``) must agree on every input: the same ``BatchError`` or none, and
the same holds, stats rows, counts and views after (records before a malformed one stay
applied in both)."""

from __future__ import annotations

from typing import Any

from inferencecache import accelerators
from inferencecache.index import batch
from inferencecache.index.clock import FakeClock
from inferencecache.index.facade import Index
from inferencecache.index.model import PROBE_TENANT, Stats
from inferencecache.index.settings import IndexSettings
from inferencecache.index.tenant_config import IndexConfig, TenantQuota

_BLOCKMAP: Any = accelerators.built("inferencecache.index._blockmap")
_SETTINGS = IndexSettings(max_entries_per_update=24, max_holds=60)
_CONFIG = IndexConfig(quotas={"q": TenantQuota(20)})


def _index() -> Index:
    factory = _BLOCKMAP.BlockMap if _BLOCKMAP is not None else None
    return Index(_SETTINGS, clock=FakeClock(), store_factory=factory, config=_CONFIG)


def _reference(st: Any, data: bytes, now: int) -> None:
    try:
        batch.apply_reference(st, data, now)
    finally:
        st.finish()


def _state(index: Index) -> tuple[Any, ...]:
    return (sorted(index.holds()), sorted(index.stats_rows()), index.counts(), index.verify())


def check(data: bytes) -> None:
    if not data.startswith(batch.MAGIC):
        data = batch.MAGIC + bytes(8) + data  # most inputs: records after a valid header
    fast, ref = _index(), _index()
    errors: list[str | None] = []
    for ix, apply in ((fast, fast.apply_batch),
                      (ref, lambda d: ref.run_locked(_reference, d, ref.clock.now_us()))):
        try:
            apply(data)
            errors.append(None)
        except batch.BatchError:
            errors.append("BatchError")
        assert ix.verify() == [], ix.verify()
    assert errors[0] == errors[1], errors
    assert _state(fast) == _state(ref)


def seeds() -> list[bytes]:
    def route(tenant: str = "t", adapter: str = "", replica: str = "r0") -> batch.Route:
        return batch.Route(tenant, "m", "vllm", adapter, replica)

    h = [i.to_bytes(8, "big") for i in range(30)]
    store = batch.Record(batch.STORE, route(), 0, 1, b"".join(h[:10]), list(range(16, 176, 16)))
    other = batch.Record(batch.STORE, route("q", "a", "r1"), 7, 2, b"".join(h[5:30]),
                         [16] * 25)
    remove = batch.Record(batch.REMOVE, route(), hashes=b"".join(h[3:6]))
    probe = batch.Record(batch.STORE, route(PROBE_TENANT), 0, 1, h[0], [16])
    return [
        batch.encode([store, other, remove]),
        batch.encode([store, batch.Record(batch.STATS, route(), stats=Stats(1, 0.5, 0.2, 3, 4)),
                      batch.Record(batch.CLEAR, route())], appended_us=5),
        batch.encode([probe, store, remove, remove]),
        batch.encode([store])[:-3],
    ]
