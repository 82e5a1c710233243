"""Which implementation runs: a compiled accelerator or its pure-Python twin.

Every C accelerator (``fingerprint._native``, ``index._blockmap``, ``index._rank``,
``ingestwire._native``, ``kvevents._native``, ``server._lookupwire``) is optional at build time
and has a twin with identical results. The rules, the same for each:

- a built accelerator is used, unless ``INFERENCECACHE_PURE_PYTHON`` is set (forces the twins);
- a missing build falls back to the twin, unless ``INFERENCECACHE_REQUIRE_NATIVE`` is set (then
  importing the module that wants it raises ImportError: a broken build must not hide behind
  the twin; ``scripts/check`` sets it). With both set, the build must exist and the twin runs.

A variable is set when its value is ``1``, ``true``, ``yes`` or ``on`` (any case).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Final

PURE_PYTHON: Final = "INFERENCECACHE_PURE_PYTHON"
REQUIRE_NATIVE: Final = "INFERENCECACHE_REQUIRE_NATIVE"

MODULES: Final = (
    "inferencecache.fingerprint._native",
    "inferencecache.index._blockmap",
    "inferencecache.index._rank",
    "inferencecache.ingestwire._native",
    "inferencecache.kvevents._native",
    "inferencecache.server._lookupwire",
)
"""Every compiled accelerator (pyproject.toml ``ext-modules``; the image build imports each)."""


def env_flag(name: str) -> bool:
    """Whether the boolean environment variable ``name`` is set."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def pure_python_forced() -> bool:
    return env_flag(PURE_PYTHON)


def native_required() -> bool:
    return env_flag(REQUIRE_NATIVE)


def built(module: str) -> ModuleType | None:
    """The compiled ``module`` if this installation built it, else None (ImportError under
    ``INFERENCECACHE_REQUIRE_NATIVE``). Ignores ``INFERENCECACHE_PURE_PYTHON``: tests use it to
    compare the build with its twin whichever one the application runs."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # not built on this machine
        if native_required():
            raise ImportError(
                f"{module} is not built and {REQUIRE_NATIVE}=1; rebuild with `pip install -e .` "
                "(needs a C compiler and Python headers)"
            ) from exc
        return None


def load(module: str) -> ModuleType | None:
    """The compiled ``module`` to use, or None when the pure-Python twin runs (not built, or
    ``INFERENCECACHE_PURE_PYTHON``)."""
    mod = built(module)
    return None if mod is None or pure_python_forced() else mod
