"""Which ``PartitionStore`` backends exist in this build, and which one the index uses.

``STORE_BACKENDS`` lists every importable backend by name; the test suite runs once per entry,
so a new backend joins the suite by appearing here. The compiled ``nativestore`` is preferred;
``INFERENCECACHE_PURE_PYTHON=1`` forces ``memstore`` and ``INFERENCECACHE_REQUIRE_NATIVE=1``
turns a missing compiled build into an import error (project convention).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from inferencecache.index.memstore import MemStore
from inferencecache.index.store import PartitionStore

StoreFactory = Callable[[], PartitionStore]

STORE_BACKENDS: dict[str, StoreFactory] = {"memstore": MemStore}

_NATIVE_MODULE = "inferencecache.index.nativestore"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _load_native() -> None:
    if _env_flag("INFERENCECACHE_PURE_PYTHON"):
        return  # forced twins: the compiled store is neither used nor required
    try:
        mod = importlib.import_module(_NATIVE_MODULE)
    except ModuleNotFoundError as e:
        if e.name == _NATIVE_MODULE:
            return  # the backend is not part of this source tree (yet)
        if _env_flag("INFERENCECACHE_REQUIRE_NATIVE"):
            raise
        return
    except ImportError:
        if _env_flag("INFERENCECACHE_REQUIRE_NATIVE"):
            raise
        return
    factory = getattr(mod, "NativeStore", None)
    if factory is not None:
        STORE_BACKENDS["nativestore"] = factory


_load_native()


def default_store_factory() -> StoreFactory:
    """The compiled store when built (and not disabled), else the pure-Python twin."""
    if not _env_flag("INFERENCECACHE_PURE_PYTHON") and "nativestore" in STORE_BACKENDS:
        return STORE_BACKENDS["nativestore"]
    return STORE_BACKENDS["memstore"]
