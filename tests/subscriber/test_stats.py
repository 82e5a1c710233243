"""The stats path with a real HTTP scrape and a real gRPC server
(engine-events-and-subscriber.md §7, engine-events-and-subscriber.md §13 items 59-72, 86)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from inferencecache.subscriber.client import CacheClient
from inferencecache.subscriber.messages import Identity
from inferencecache.subscriber.metrics import SubscriberMetrics
from inferencecache.subscriber.stats import (
    Families,
    SglangProfile,
    StatsReporter,
    VllmProfile,
    make_profile,
)
from inferencecache.web import Listener
from tests.subscriber.recorder import RecordingServer

IDENT = Identity("replica-a", "model-x", "tenant-t", "vllm")
GIB = 1 << 30


def vllm_text(hits: float | None = 25, queries: float | None = 100, *, usage: float = 0.42,
              running: float = 3, waiting: float = 5, ext: tuple[float, float] | None = None,
              total_suffix: bool = True, model: str = "m") -> str:
    lab = f'{{model_name="{model}",engine="0"}}'
    lines = [
        "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{lab} {usage}",
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{lab} {running}",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{lab} {waiting}",
    ]

    def counter(name: str, value: float) -> None:
        if total_suffix:
            lines.extend([f"# TYPE {name}_total counter", f"{name}_total{lab} {value}",
                          f"# TYPE {name}_created gauge", f"{name}_created{lab} 1.7e9"])
        else:
            lines.extend([f"# TYPE {name} counter", f"{name}{lab} {value}"])

    if hits is not None:
        counter("vllm:prefix_cache_hits", hits)
    if queries is not None:
        counter("vllm:prefix_cache_queries", queries)
    if ext is not None:
        counter("vllm:external_prefix_cache_hits", ext[0])
        counter("vllm:external_prefix_cache_queries", ext[1])
    return "\n".join(lines) + "\n"


class Engine:
    """A real aiohttp server serving ``body`` with ``status`` at /metrics."""

    def __init__(self) -> None:
        self.body = ""
        self.status = 200
        self.listener: Listener | None = None
        self.url = ""

    async def _metrics(self, _r: web.Request) -> web.Response:
        return web.Response(text=self.body, status=self.status)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.listener = Listener(app)
        port = await self.listener.start("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}/metrics"

    async def stop(self) -> None:
        if self.listener is not None:
            await self.listener.stop()


class Kit:
    def __init__(self, parts: tuple[Engine, RecordingServer], profile: Any,
                 model_name: str = "") -> None:
        engine, server = parts
        self.engine = engine
        self.server = server
        self.client = CacheClient(server.address)
        self.metrics = SubscriberMetrics()
        self.reporter = StatsReporter(self.client, IDENT, self.metrics, profile,
                                      url=engine.url, interval=60, model_name=model_name,
                                      scrape_timeout=2.0)

    async def tick(self, body: str | None = None) -> Any:
        if body is not None:
            self.engine.body = body
        before = len(self.server.servicer.updates())
        ok = await self.reporter.tick()
        if not ok:
            return None
        assert len(self.server.servicer.updates()) == before + 1
        return self.server.servicer.updates()[-1]

    def value(self, name: str, **labels: str) -> float:
        v = self.metrics.registry.get_sample_value(
            "inferencecache_subscriber_" + name, labels or None)
        return 0.0 if v is None else v


@pytest.fixture
async def parts() -> AsyncIterator[tuple[Engine, RecordingServer]]:
    engine = Engine()
    await engine.start()
    async with RecordingServer() as server:
        yield engine, server
    await engine.stop()


def vllm(size: int = GIB, ceiling: int = 256, tier: str = "auto") -> VllmProfile:
    return VllmProfile(tier, size, ceiling)


async def test_s13_59_60_hit_rate_from_counter_deltas(parts: Any) -> None:
    k = Kit(parts, vllm())
    first = await k.tick(vllm_text(25, 100))
    assert first.stats.hit_rate == 0.0
    second = await k.tick(vllm_text(95, 200))
    assert second.stats.hit_rate == pytest.approx(0.7)
    await k.client.close()


async def test_s13_61_counter_reset_gives_zero_then_deltas_from_new_baseline(parts: Any) -> None:
    k = Kit(parts, vllm())
    await k.tick(vllm_text(50, 100))
    assert (await k.tick(vllm_text(10, 120))).stats.hit_rate == 0.0
    assert (await k.tick(vllm_text(20, 140))).stats.hit_rate == pytest.approx(0.5)
    assert (await k.tick(vllm_text(30, 140))).stats.hit_rate == 0.0  # no queries: rebase
    await k.client.close()


async def test_s13_62_missing_counter_gives_zero_and_keeps_the_baseline(parts: Any) -> None:
    k = Kit(parts, vllm())
    await k.tick(vllm_text(10, 100))
    assert (await k.tick(vllm_text(None, 150))).stats.hit_rate == 0.0
    assert (await k.tick(vllm_text(40, 200))).stats.hit_rate == pytest.approx(0.3)
    await k.client.close()


@pytest.mark.parametrize("total_suffix", [True, False], ids=["name_total", "name"])
async def test_s13_63_counters_declared_either_way(parts: Any, total_suffix: bool) -> None:
    k = Kit(parts, vllm())
    await k.tick(vllm_text(0, 0, total_suffix=total_suffix, ext=(3, 4)))
    u = await k.tick(vllm_text(50, 100, total_suffix=total_suffix, ext=(7, 9)))
    assert u.stats.hit_rate == pytest.approx(0.5)
    assert (u.stats.t2_hit_tokens, u.stats.t2_query_tokens) == (7, 9)
    await k.client.close()


def test_untyped_and_created_series_are_never_read() -> None:
    f = Families("vllm:prefix_cache_hits_total 5\n# TYPE x_created gauge\nx_created 1\n")
    assert f.counter("vllm:prefix_cache_hits") is None
    assert f.gauge("x_created") == 1.0  # a gauge named *_created is still a gauge


async def test_s13_64_cache_memory_bytes(parts: Any) -> None:
    k = Kit(parts, vllm(size=GIB))
    assert (await k.tick(vllm_text(usage=0.42))).stats.cache_memory_bytes == 450971566
    k2 = Kit(parts, vllm(size=0))
    assert (await k2.tick(vllm_text(usage=0.42))).stats.cache_memory_bytes == 0
    await k.client.close()
    await k2.client.close()


def test_s13_65_usage_gauge_selection() -> None:
    both = ("# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.2\n"
            "# TYPE vllm:cpu_cache_usage_perc gauge\nvllm:cpu_cache_usage_perc 0.6\n")
    kv = "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.1\n"
    size = 1000

    def mem(text: str, tier: str) -> int:
        return VllmProfile(tier, size, 256).compute(Families(text)).cache_memory_bytes

    assert mem(kv + both, "auto") == 100
    assert mem(both, "auto") == 600
    assert mem(kv + both, "gpu") == 200
    assert mem(kv + both, "cpu") == 600
    assert mem(both, "kv") == 0
    assert mem("", "auto") == 0


def test_s13_66_model_name_filter_excludes_other_and_unlabeled_series() -> None:
    text = ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.9\n"
            'vllm:kv_cache_usage_perc{model_name="other"} 0.8\n'
            'vllm:kv_cache_usage_perc{model_name="mine"} 0.3\n'
            "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits 100\n"
            'vllm:prefix_cache_hits{model_name="mine"} 7\n')
    f = Families(text, model_name="mine")
    assert f.gauge("vllm:kv_cache_usage_perc") == 0.3
    assert f.counter("vllm:prefix_cache_hits") == 7
    assert Families(text).gauge("vllm:kv_cache_usage_perc") == 0.9  # empty filter: first series


@pytest.mark.parametrize(
    ("running", "waiting", "ceiling", "pressure"),
    [(3, 5, 256, 0.03125), (3, 5, 0, 0.0), (300, 5, 256, 1.0), (0, 0, 256, 0.0)],
)
def test_s13_67_pressure(running: float, waiting: float, ceiling: int, pressure: float) -> None:
    v = VllmProfile("auto", 0, ceiling).compute(
        Families(vllm_text(running=running, waiting=waiting)))
    assert v.pressure == pytest.approx(pressure)


def test_s13_68_external_counters_raw_or_zero() -> None:
    p = VllmProfile("auto", 0, 256)
    v = p.compute(Families(vllm_text(ext=(123, 456))))
    assert (v.t2_hit_tokens, v.t2_query_tokens) == (123, 456)
    v = p.compute(Families(vllm_text()))
    assert (v.t2_hit_tokens, v.t2_query_tokens) == (0, 0)


async def test_s13_69_stats_update_shape(parts: Any) -> None:
    k = Kit(parts, vllm())
    before = time.time()
    u = await k.tick(vllm_text())
    assert list(u.prefixes) == []
    assert u.stats.replica_id == u.replica_id == "replica-a"
    assert (u.model_id, u.tenant_id, u.hash_scheme) == ("model-x", "tenant-t", "vllm")
    assert before * 1e6 - 1e6 <= u.timestamp_us <= time.time() * 1e6 + 1e6
    assert u.stats.pressure == pytest.approx(0.03125)
    await k.client.close()


def _refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/metrics"


async def test_s13_70_http_500_or_refused_fails_the_tick_only(parts: Any) -> None:
    engine, server = parts
    k = Kit((engine, server), vllm())
    engine.status = 500
    assert await k.tick(vllm_text()) is None
    k.reporter.url = _refused_url()
    assert await k.tick() is None
    assert k.value("stats_ticks_total", result="scrape_failed") == 2
    engine.status = 200
    k.reporter.url = engine.url
    assert await k.tick(vllm_text()) is not None
    assert k.value("stats_ticks_total", result="ok") == 1
    engine.body = "garbage{{{ not prometheus"
    assert await k.tick() is None
    await k.client.close()


async def test_s13_71_staleness_escalation(parts: Any, caplog: pytest.LogCaptureFixture) -> None:
    engine, server = parts
    caplog.set_level(logging.DEBUG, logger="inferencecache.subscriber")
    k = Kit((engine, server), vllm())
    engine.status = 500
    for _ in range(5):
        await k.tick(vllm_text())
    levels = [(r.levelname, getattr(r, "event", None)) for r in caplog.records
              if r.name == "inferencecache.subscriber"]
    assert levels == [("WARNING", None), ("WARNING", None), ("ERROR", "load_signal_stale"),
                      ("DEBUG", None), ("DEBUG", None)]
    stale = next(r for r in caplog.records if getattr(r, "event", None) == "load_signal_stale")
    assert stale.consecutive_failures == 3  # type: ignore[attr-defined]
    assert "never" in stale.getMessage()
    caplog.clear()
    engine.status = 200
    await k.tick(vllm_text())
    recovered = [r for r in caplog.records if getattr(r, "event", None) == "load_signal_recovered"]
    assert len(recovered) == 1 and recovered[0].levelname == "INFO"
    assert recovered[0].after_failures == 5  # type: ignore[attr-defined]
    # After a delivery, the stale message says so.
    caplog.clear()
    engine.status = 500
    for _ in range(3):
        await k.tick()
    stale = next(r for r in caplog.records if getattr(r, "event", None) == "load_signal_stale")
    assert "never" not in stale.getMessage()
    await k.client.close()


async def test_s13_72_accepted_false_is_a_failed_tick(parts: Any) -> None:
    engine, server = parts
    server.servicer.accepted = False
    k = Kit((engine, server), vllm())
    assert await k.tick(vllm_text()) is None
    assert k.reporter.failures == 1
    assert k.value("stats_ticks_total", result="rejected") == 1
    await k.client.close()


async def test_unreachable_server_fails_the_tick(parts: Any) -> None:
    engine, _ = parts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = RecordingServer(s.getsockname()[1])
    k = Kit((engine, dead), vllm())
    engine.body = vllm_text()
    assert await k.reporter.tick() is False
    assert k.value("rpc_failures_total", rpc="stats") == 1
    await k.client.close()


SGL = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 3
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",priority=""} 5
sglang:num_queue_reqs{model_name="m",priority="1"} 5
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.63
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.75
"""


async def test_s13_86_sglang_profile(parts: Any) -> None:
    k = Kit(parts, make_profile("sglang", "auto", 1000, 256))
    u = await k.tick(SGL)
    assert u.stats.pressure == pytest.approx(0.03125)
    assert u.stats.hit_rate == pytest.approx(0.75)  # first scrape already meaningful
    assert u.stats.cache_memory_bytes == 630  # usage 0.63
    assert (u.stats.t2_hit_tokens, u.stats.t2_query_tokens) == (0, 0)
    without_queue = "\n".join(line for line in SGL.splitlines() if "num_queue" not in line)
    assert await k.tick(without_queue + "\n") is None
    assert await k.tick(vllm_text()) is None  # no sglang:* family at all
    await k.client.close()


def test_sglang_gpu_cpu_tiers_and_nan_samples() -> None:
    text = SGL + "sglang:cache_hit_rate{model_name=\"x\"} NaN\n"
    assert SglangProfile("gpu", 1000, 256).compute(Families(text)).cache_memory_bytes == 0
    assert SglangProfile("kv", 1000, 256).compute(Families(text)).cache_memory_bytes == 630
    assert SglangProfile("auto", 0, 256).compute(Families(text)).hit_rate == pytest.approx(0.75)


def test_unknown_scheme_uses_vllm_profile_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert isinstance(make_profile("custom", "auto", 0, 256), VllmProfile)
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    caplog.clear()
    assert isinstance(make_profile("vllm", "auto", 0, 256), VllmProfile)
    assert not caplog.records


async def test_first_tick_after_one_interval_and_start_stop_logs(
    parts: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine, server = parts
    caplog.set_level(logging.INFO, logger="inferencecache.subscriber")
    k = Kit((engine, server), vllm())
    engine.body = vllm_text()
    k.reporter.interval = 0.2
    task = asyncio.create_task(k.reporter.run())
    await asyncio.sleep(0.1)
    assert server.servicer.updates() == []
    await server.servicer.wait_for(lambda: server.servicer.updates(), timeout=3)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    msgs = [r.getMessage() for r in caplog.records]
    assert "stats reporter starting" in msgs and "stats reporter stopped" in msgs
    await k.client.close()
