"""The compiled store's module for the nativestore tests, or None when it is not built.

Imported directly (not through ``nativestore``) so the C type is tested even when
``INFERENCECACHE_PURE_PYTHON`` steers the application to the twin; a missing build is an error
under ``INFERENCECACHE_REQUIRE_NATIVE`` (``scripts/check``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load() -> ModuleType | None:
    try:
        return importlib.import_module("inferencecache.index._blockmap")
    except ImportError:
        flag = os.environ.get("INFERENCECACHE_REQUIRE_NATIVE", "").strip().lower()
        if flag not in ("", "0", "false", "no"):
            raise
        return None


BLOCKMAP = load()


def load_rank() -> ModuleType | None:
    """The compiled ranker (``_rank``), imported directly for the same reason."""
    try:
        return importlib.import_module("inferencecache.index._rank")
    except ImportError:
        flag = os.environ.get("INFERENCECACHE_REQUIRE_NATIVE", "").strip().lower()
        if flag not in ("", "0", "false", "no"):
            raise
        return None


RANK = load_rank()
