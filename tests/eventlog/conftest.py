"""A private redis-server per test (127.0.0.1, free port, temp dir), stopped by its PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inferencecache.procs import RedisServer


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    d = tmp_path / "redis"
    d.mkdir()
    server = RedisServer(str(d)).start()
    try:
        yield server
    finally:
        server.stop()
