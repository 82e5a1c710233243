"""Which implementation runs: a compiled accelerator or pure Python, and how often compiled code
handed work back to Python.

Every C accelerator (``fingerprint._native``, ``index._blockmap``, ``index._rank``,
``updatewire._native``, ``kvevents._native``, ``server._lookupwire``) is optional at build time.
Without it the package runs pure Python: a twin with identical results (fingerprint, store,
ranker, engine arrays) or protobuf itself (the contract's wire parsers). The rules, the same for
each:

- a built accelerator is used, unless ``INFERENCECACHE_PURE_PYTHON`` is set: a true value
  (``1``, ``true``, ``yes``, ``on``) forces pure Python everywhere; a comma-separated list of
  accelerator names (``index._rank,server._lookupwire``) forces it for those only, which is
  how ``docs/decisions.md`` measures what each accelerator buys;
- a missing build falls back to Python, unless ``INFERENCECACHE_REQUIRE_NATIVE`` is set (then
  importing the module that wants it raises ImportError: a broken build must not hide behind
  Python; ``scripts/check`` sets it). With both set, the build must exist and Python runs.

``FALLBACKS`` counts, per site, the calls a compiled accelerator declined (an input it does not
mirror exactly, e.g. a NaN score or a message shape it leaves to protobuf) so Python did the
work instead; the server and the subscriber export it as
``inferencecache_native_fallbacks_total{site}``.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from types import ModuleType
from typing import Final

PURE_PYTHON: Final = "INFERENCECACHE_PURE_PYTHON"
REQUIRE_NATIVE: Final = "INFERENCECACHE_REQUIRE_NATIVE"
_TRUE = ("1", "true", "yes", "on")

FALLBACKS: Counter[str] = Counter()
"""Calls per site that a compiled accelerator handed back to Python (process-wide)."""


def fell_back(site: str) -> None:
    """Count one call that compiled code handed back to Python at ``site``."""
    FALLBACKS[site] += 1


MODULES: Final = (
    "inferencecache.fingerprint._native",
    "inferencecache.index._blockmap",
    "inferencecache.index._rank",
    "inferencecache.kvevents._native",
    "inferencecache.server._lookupwire",
    "inferencecache.updatewire._native",
)
"""Every compiled accelerator (pyproject.toml ``ext-modules``; the image build imports each)."""


def env_flag(name: str) -> bool:
    """Whether the boolean environment variable ``name`` is set."""
    return os.environ.get(name, "").strip().lower() in _TRUE


def pure_python_forced(module: str | None = None) -> bool:
    """Whether ``INFERENCECACHE_PURE_PYTHON`` forces pure Python for ``module`` (a full or
    short accelerator name such as ``index._rank``), or for every accelerator when None."""
    value = os.environ.get(PURE_PYTHON, "").strip()
    if value.lower() in _TRUE:
        return True
    if module is None or not value:
        return False
    short = module.removeprefix("inferencecache.")
    return any(name.strip().removeprefix("inferencecache.") == short for name in value.split(","))


def native_required() -> bool:
    return env_flag(REQUIRE_NATIVE)


def built(module: str) -> ModuleType | None:
    """The compiled ``module`` if this installation built it, else None (ImportError under
    ``INFERENCECACHE_REQUIRE_NATIVE``). Ignores ``INFERENCECACHE_PURE_PYTHON``: tests use it to
    compare the build with Python whichever one the application runs."""
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
    """The compiled ``module`` to use, or None when Python runs (not built, or forced by
    ``INFERENCECACHE_PURE_PYTHON``)."""
    mod = built(module)
    return None if mod is None or pure_python_forced(module) else mod
