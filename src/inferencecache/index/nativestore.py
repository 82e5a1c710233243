"""The compiled ``PartitionStore``: ``NativeStore`` is the C type ``_blockmap.BlockMap``.

The C type implements the Protocol of ``store.py`` directly (its ``walk`` builds
``store.Run`` tuples in C, ``holds()`` yields ``store.Hold``), so there is no Python layer on
the hot path. Design and measurements: ``docs/index-store.md``.

Importing this module raises ``ImportError`` when the extension was not built or when
``INFERENCECACHE_PURE_PYTHON`` is set; ``index/backends.py`` decides whether that is fatal
(``INFERENCECACHE_REQUIRE_NATIVE``) or falls back to the pure-Python twin ``memstore``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferencecache import accelerators

if accelerators.pure_python_forced("index._blockmap"):
    raise ImportError("inferencecache.index.nativestore is disabled by INFERENCECACHE_PURE_PYTHON")

from inferencecache.index._blockmap import Applier, BlockMap

NativeStore = BlockMap
"""Factory of the compiled store: ``NativeStore()`` is an empty partition."""

__all__ = ["Applier", "BlockMap", "NativeStore"]

if TYPE_CHECKING:
    from inferencecache.index.store import PartitionStore

    def _conforms(store: BlockMap) -> PartitionStore:
        return store  # mypy proves BlockMap satisfies the Protocol
