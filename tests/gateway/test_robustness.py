"""No single request or engine answer stops the gateway (issue 15 item 1): the worst request
bodies over real HTTP into a running gateway, hostile engine answers to its health and model
probes, and injected bugs in the request path and the health watchers. Each time the request
is answered (4xx, or a counted 500), and a valid request afterwards is proxied."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from inferencecache.gateway.app import Gateway
from inferencecache.supervise import DROP_REASONS
from tests.gateway.support import (
    LOOPBACK,
    client,
    engines,
    engines_flag,
    gateway,
    post,
    settings,
    wait_until,
)


def drops(gw: Gateway, loop: str) -> float:
    total = 0.0
    for reason in DROP_REASONS:
        v = gw.metrics.registry.get_sample_value(
            "inferencecache_gateway_dropped_inputs_total", {"loop": loop, "reason": reason})
        total += v or 0.0
    return total


WORST_BODIES: dict[str, tuple[str, bytes]] = {
    "deep_array": ("/v1/completions", b"[" * 100_000),
    "deep_object": ("/v1/completions", b'{"a":' * 100_000),
    "deep_prompt": ("/v1/completions", b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000
                    + b"}"),
    "deep_messages": ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", '
                      b'"content": ' + b"[" * 50_000 + b"]" * 50_000 + b"}]}"),
    "invalid_utf8": ("/v1/completions", b'{"model": "m", "prompt": "\xff\xfe\xed\xa0\x80"}'),
    "invalid_utf8_model": ("/v1/completions", b'{"model": "\xc3\x28", "prompt": [1]}'),
    "uint64_tokens": ("/v1/completions", b'{"model": "m", "prompt": [18446744073709551615]}'),
    "over_uint64_tokens": ("/v1/completions", b'{"model": "m", "prompt": [18446744073709551616]}'),
    "negative_2_64": ("/v1/completions", b'{"model": "m", "prompt": [-18446744073709551616]}'),
    "huge_number": ("/v1/completions", b'{"model": "m", "prompt": [1' + b"0" * 100_000 + b"]}"),
    "many_keys": ("/v1/completions",
                     b'{"model": "m", ' + b"".join(b'"k%d": 0, ' % i for i in range(60_000))
                     + b'"prompt": 5}'),
    "nan": ("/v1/completions", b'{"model": "m", "prompt": [NaN]}'),
    "model_object": ("/v1/completions", b'{"model": {"a": [1]}, "prompt": [1]}'),
}


async def test_worst_request_bodies_are_4xx_and_the_gateway_goes_on() -> None:
    async with engines("a") as stubs, gateway(settings(engines_flag(stubs))) as (gw, url), \
            client() as c:
        for name, (path, body) in WORST_BODIES.items():
            status, _, payload = await post(c, url, body, path=path)
            assert 400 <= status < 500, (name, status, payload)
            assert isinstance(payload, dict) and "error" in payload, name
        million_tokens = json.dumps({"model": "m", "prompt": list(range(1_000_000))}).encode()
        status, headers, _ = await post(c, url, million_tokens)
        # large but valid: fingerprinted off the loop and proxied (the stub engine itself
        # refuses bodies over aiohttp's 1 MiB default: its 413 is relayed)
        assert status in (200, 413) and headers["X-Cache-Route-Replica"] == "r0"
        assert drops(gw, "proxy") == drops(gw, "http") == 0
        assert (await post(c, url, {"model": "m", "prompt": [1, 2]}))[0] == 200
        async with c.get(url + "/healthz") as r:
            assert r.status == 200


@asynccontextmanager
async def hostile_engine(models_body: bytes) -> AsyncIterator[str]:
    """A real HTTP engine whose /v1/models answers ``models_body`` (and completes requests)."""

    async def models(_r: web.Request) -> web.Response:
        return web.Response(body=models_body, content_type="application/json")

    async def health(_r: web.Request) -> web.Response:
        return web.Response(text="")

    async def completion(_r: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completion)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, LOOPBACK, 0)
    await site.start()
    try:
        yield f"http://{LOOPBACK}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_hostile_engine_model_lists_are_ignored() -> None:
    for body in (b"[" * 100_000, b'{"data": ' + b"[" * 100_000, b'{"data": [{"id": "\xff"}]}',
                 b'{"data": [' + b'{"id": 1},' * 200_000 + b'{"id": "m"}]}', b"\x00" * 1000):
        async with hostile_engine(body) as engine_url, \
                gateway(settings(f"r0={engine_url}")) as (gw, url), client() as c:
            status, _, _ = await post(c, url, {"model": "m", "prompt": [1, 2]})
            assert status == 200, body[:20]
            async with c.get(url + "/v1/models") as r:
                assert r.status == 200, body[:20]
            assert drops(gw, "health") == drops(gw, "http") == 0


async def test_a_bug_in_the_request_path_is_a_counted_500_for_that_request_only() -> None:
    async with engines("a") as stubs, gateway(settings(engines_flag(stubs))) as (gw, url), \
            client() as c:
        real = gw.policy.choose
        calls = 0

        def choose(route: Any, healthy: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise IndexError("policy bug")
            return real(route, healthy)

        gw.policy.choose = choose  # type: ignore[method-assign]
        status, _, payload = await post(c, url, {"model": "m", "prompt": [1, 2]})
        assert status == 500 and payload["error"]["code"] == "internal_error"
        assert gw.metrics.registry.get_sample_value(
            "inferencecache_gateway_dropped_inputs_total",
            {"loop": "proxy", "reason": "lookup"}) == 1
        assert (await post(c, url, {"model": "m", "prompt": [1, 2]}))[0] == 200


async def test_a_dead_health_watcher_is_restarted_and_healthz_says_degraded() -> None:
    async with engines("a") as stubs, gateway(settings(engines_flag(stubs))) as (gw, url), \
            client() as c:
        gw.metrics.loops.backoff_min = gw.metrics.loops.backoff_max = 0.3
        engine = gw.pool.engines["r0"]
        wake = engine.wake
        engine.wake = None  # type: ignore[assignment]  # the watcher dies on its next wait
        await wait_until(lambda: (gw.metrics.registry.get_sample_value(
            "inferencecache_gateway_loop_restarts_total", {"loop": "health-r0"}) or 0) >= 1)
        async with c.get(url + "/healthz") as r:
            body = await r.json()
            assert r.status == 503
            assert body["status"].startswith("degraded: health-r0 restarting")
        # requests are still served meanwhile
        assert (await post(c, url, {"model": "m", "prompt": [1, 2]}))[0] == 200
        engine.wake = wake
        await wait_until(lambda: not gw.metrics.loops.degraded())
        async with c.get(url + "/healthz") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        probes = stubs[0].health_probes
        gw.pool.suspect("r0")
        await wait_until(lambda: stubs[0].health_probes > probes)  # the watcher works again


async def test_a_probe_that_raises_is_counted_and_the_watcher_goes_on() -> None:
    async with engines("a") as stubs, gateway(settings(engines_flag(stubs))) as (gw, _url):
        pool = gw.pool
        real = pool._probe
        calls = 0

        async def probe(e: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise TypeError("probe bug")
            await real(e)

        pool._probe = probe  # type: ignore[method-assign]
        pool.suspect("r0")
        await wait_until(lambda: drops(gw, "health") == 1)
        probes = stubs[0].health_probes
        pool.suspect("r0")
        await wait_until(lambda: stubs[0].health_probes > probes)  # the next probe ran
        assert drops(gw, "health") == 1
        assert gw.metrics.registry.get_sample_value(
            "inferencecache_gateway_loop_restarts_total", {"loop": "health-r0"}) == 0
