"""Fixtures of the index suite: every test that touches holds runs once per store backend.

``STORE_BACKENDS`` (``inferencecache.index.backends``) lists the importable backends, so a new
backend joins the whole suite by registering there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from inferencecache.index import STORE_BACKENDS
from inferencecache.index.store import PartitionStore
from tests.index.support import Env


@pytest.fixture(params=sorted(STORE_BACKENDS))
def store_factory(request: pytest.FixtureRequest) -> Callable[[], PartitionStore]:
    factory: Callable[[], PartitionStore] = STORE_BACKENDS[request.param]
    return factory


@pytest.fixture
def make_env(store_factory: Callable[[], PartitionStore]) -> Iterator[Callable[..., Env]]:
    made: list[Env] = []

    def make(**kw: Any) -> Env:
        e = Env(store_factory, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
        assert e.index.verify() == []


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()
