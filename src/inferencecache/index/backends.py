"""Which ``PartitionStore`` backends exist in this build, and which one the index uses.

``STORE_BACKENDS`` lists every importable backend by name; the test suite runs once per entry,
so a new backend joins the suite by appearing here. The compiled ``nativestore`` is preferred;
``INFERENCECACHE_PURE_PYTHON=1`` forces ``memstore`` and ``INFERENCECACHE_REQUIRE_NATIVE=1``
turns a missing compiled build into an import error (project convention).
"""

from __future__ import annotations

from collections.abc import Callable

from inferencecache import accelerators
from inferencecache.index.memstore import MemStore
from inferencecache.index.store import PartitionStore

StoreFactory = Callable[[], PartitionStore]

STORE_BACKENDS: dict[str, StoreFactory] = {"memstore": MemStore}


def _load_native() -> None:
    if accelerators.load("inferencecache.index._blockmap") is None:
        return  # not built, or the twins are forced
    from inferencecache.index.nativestore import NativeStore

    STORE_BACKENDS["nativestore"] = NativeStore


_load_native()


def default_store_factory() -> StoreFactory:
    """The compiled store when built (and not disabled), else the pure-Python twin."""
    if not accelerators.pure_python_forced() and "nativestore" in STORE_BACKENDS:
        return STORE_BACKENDS["nativestore"]
    return STORE_BACKENDS["memstore"]
