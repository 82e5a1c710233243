"""Hypothesis profiles for the whole suite.

``ci`` (chosen by ``scripts/check`` through ``INFERENCECACHE_HYPOTHESIS_PROFILE=ci``, or by a
``CI`` environment variable): derandomized (the examples are a function of the test alone), no
example database and no deadline, so a CI run can only fail on an example every run tries, never
on one an earlier run happened to find or on a slow moment of a shared machine. ``dev``
(default): random examples, as Hypothesis does by default, to keep finding new ones locally.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev")
settings.load_profile(
    os.environ.get("INFERENCECACHE_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)
