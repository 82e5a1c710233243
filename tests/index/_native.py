"""The compiled index modules for the nativestore and ranking tests, or None when not built.

Imported directly (not through ``nativestore``/``ranking``) so the C types are tested even when
``INFERENCECACHE_PURE_PYTHON`` steers the application to the twins; a missing build is an error
under ``INFERENCECACHE_REQUIRE_NATIVE`` (``scripts/check``).
"""

from __future__ import annotations

from inferencecache import accelerators

BLOCKMAP = accelerators.built("inferencecache.index._blockmap")
RANK = accelerators.built("inferencecache.index._rank")
"""The compiled ranker (``_rank``)."""
