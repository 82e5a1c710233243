"""Which ``PartitionStore`` backends exist in this build, and which one the index uses.

``STORE_BACKENDS`` lists every importable backend by name (``serve --store-backend``); the test
suite runs once per entry, so a new backend joins the suite by appearing here. ``native`` (the
compiled ``nativestore``) is the default when built; ``python`` (``memstore``) always exists.
``INFERENCECACHE_PURE_PYTHON`` leaves ``native`` out and ``INFERENCECACHE_REQUIRE_NATIVE`` turns
a missing compiled build into an import error (``inferencecache.accelerators``).
"""

from __future__ import annotations

from collections.abc import Callable

from inferencecache import accelerators
from inferencecache.index.memstore import MemStore
from inferencecache.index.store import PartitionStore

StoreFactory = Callable[[], PartitionStore]

STORE_BACKENDS: dict[str, StoreFactory] = {"python": MemStore}


def _load_native() -> None:
    if accelerators.load("inferencecache.index._blockmap") is None:
        return  # not built, or forced off
    from inferencecache.index.nativestore import NativeStore

    STORE_BACKENDS["native"] = NativeStore


_load_native()


def store_factory(name: str | None = None) -> StoreFactory:
    """The backend called ``name``, or the default (``native`` when available, else
    ``python``); KeyError naming the available ones for an unknown name."""
    if name is None:
        name = "native" if "native" in STORE_BACKENDS else "python"
    try:
        return STORE_BACKENDS[name]
    except KeyError:
        raise KeyError(
            f"store backend {name!r} is not available (have: {', '.join(sorted(STORE_BACKENDS))})"
        ) from None


def default_store_factory() -> StoreFactory:
    """The compiled store when built (and not disabled), else the pure-Python one."""
    return store_factory()
