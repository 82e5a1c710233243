"""Engine health: a dead engine is skipped (never retried in a loop) and comes back when healthy."""

from __future__ import annotations

from tests.gateway.support import (
    StubEngine,
    client,
    dead_url,
    engines,
    gateway,
    metric_value,
    post,
    settings,
    wait_until,
)


async def metrics_page(c, url) -> str:
    async with c.get(url + "/metrics") as r:
        return str((await r.read()).decode())


async def test_an_engine_down_at_start_is_skipped():
    async with engines("b") as stubs, gateway(
        settings(f"r0={dead_url()},r1={stubs[0].url}", routing_policy="round_robin")
    ) as (gw, url), client() as c:
        assert gw.pool.healthy_ids() == ["r1"]
        for _ in range(6):
            status, headers, _ = await post(c, url, {"model": "m", "prompt": [1, 2]})
            assert status == 200 and headers["X-Cache-Route-Replica"] == "r1"
            assert "X-Cache-Route-Attempts" not in headers
        page = await metrics_page(c, url)
        assert metric_value(page, "inferencecache_gateway_engine_up", replica="r0") == 0
        assert metric_value(
            page, "inferencecache_gateway_upstream_errors_total", replica="r0", kind="connect"
        ) == 0  # never dialled by a request


async def test_an_engine_that_dies_is_retried_once_then_skipped_and_comes_back():
    a = await StubEngine("a").start()
    b = await StubEngine("b").start()
    port_a = a.port
    try:
        async with gateway(
            settings(
                f"r0={a.url},r1={b.url}",
                routing_policy="round_robin",
                health_interval=30.0,  # only the failure path may notice
                health_backoff_max=0.3,
            )
        ) as (gw, url), client() as c:
            await a.stop()
            outcomes = []
            for _ in range(6):
                status, headers, body = await post(c, url, {"model": "m", "prompt": [1, 2]})
                assert status == 200 and body["served_by"] == "b"
                outcomes.append(headers.get("X-Cache-Route-Attempts", "1"))
            assert outcomes.count("2") == 1  # one request found r0 dead and moved on
            assert gw.pool.healthy_ids() == ["r1"]
            page = await metrics_page(c, url)
            assert metric_value(
                page, "inferencecache_gateway_upstream_errors_total", replica="r0",
                kind="connect",
            ) == 1
            # the engine comes back on the same port: probes with backoff find it
            a = await StubEngine("a").start(port=port_a)
            await wait_until(lambda: gw.pool.healthy_ids() == ["r0", "r1"], timeout=10)
            served = set()
            for _ in range(4):
                _, _, body = await post(c, url, {"model": "m", "prompt": [1, 2]})
                served.add(body["served_by"])
            assert served == {"a", "b"}
    finally:
        await a.stop()
        await b.stop()


async def test_failing_health_probe_takes_an_engine_out_and_in():
    async with engines("a", "b") as stubs, gateway(
        settings(f"r0={stubs[0].url},r1={stubs[1].url}", routing_policy="round_robin")
    ) as (gw, url), client() as c:
        stubs[0].health_status = 503
        await wait_until(lambda: gw.pool.healthy_ids() == ["r1"], timeout=10)
        for _ in range(3):
            _, headers, _ = await post(c, url, {"model": "m", "prompt": [1]})
            assert headers["X-Cache-Route-Replica"] == "r1"
        stubs[0].health_status = 200
        await wait_until(lambda: gw.pool.healthy_ids() == ["r0", "r1"], timeout=10)


async def test_a_5xx_answer_is_passed_through_and_triggers_an_early_probe():
    async with engines("a", completion_status=503) as stubs, gateway(
        settings(f"r0={stubs[0].url}", health_interval=30.0)
    ) as (gw, url), client() as c:
        probes = stubs[0].health_probes
        status, _, body = await post(c, url, {"model": "m", "prompt": [1]})
        assert status == 503 and body["error"]["message"] == "engine says no"
        await wait_until(lambda: stubs[0].health_probes > probes, timeout=5)
        assert gw.pool.healthy_ids() == ["r0"]  # /health is fine: the engine stays in
        page = await metrics_page(c, url)
        assert metric_value(
            page, "inferencecache_gateway_upstream_errors_total", replica="r0", kind="status_5xx"
        ) == 1


async def test_engines_not_serving_the_model_are_not_chosen():
    async with engines("a", models=[{"id": "m"}]) as a, engines(
        "b", models=[{"id": "m"}, {"id": "big"}]
    ) as b, gateway(
        settings(f"r0={a[0].url},r1={b[0].url}", routing_policy="round_robin")
    ) as (_, url), client() as c:
        for _ in range(4):
            status, headers, _ = await post(c, url, {"model": "big", "prompt": [1]})
            assert status == 200 and headers["X-Cache-Route-Replica"] == "r1"


async def test_when_every_engine_fails_mid_request_the_answer_is_503():
    a = await StubEngine("a").start()
    try:
        async with gateway(
            settings(f"r0={a.url}", health_interval=30.0)
        ) as (_gw, url), client() as c:
            await a.stop()
            status, _, body = await post(c, url, {"model": "m", "prompt": [1]})
            assert status == 503
            assert body["error"]["code"] == "no_healthy_engine"
            assert "every engine tried failed" in body["error"]["message"]
    finally:
        await a.stop()
