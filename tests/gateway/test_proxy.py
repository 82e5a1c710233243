"""The gateway as a reverse proxy: bodies, headers, streaming, the small endpoints."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.gateway.support import (
    client,
    engines,
    engines_flag,
    gateway,
    metric_value,
    post,
    raw_engine,
    settings,
    wait_until,
)


async def test_body_reaches_the_engine_byte_for_byte_and_answer_comes_back():
    raw = b'{"model": "m",   "prompt": [1, 2, 3], "max_tokens": 5, "x_extra": {"k": [1]}}'
    async with engines("a") as stubs, gateway(settings(engines_flag(stubs))) as (_, url), \
            client() as c:
        status, headers, body = await post(
            c, url, raw, headers={"Authorization": "Bearer sk-1", "X-Request-Id": "abc"}
        )
        assert status == 200
        assert body["served_by"] == "a" and body["choices"][0]["text"] == "from a"
        (got,) = stubs[0].completions
        assert got.body == raw
        assert got.path == "/v1/completions"
        assert got.headers["Authorization"] == "Bearer sk-1"
        assert got.headers["X-Request-Id"] == "abc"
        assert headers["X-Cache-Route-Replica"] == "r0"
        assert headers["X-Cache-Route-Prompt-Tokens"] == "3"
        assert int(headers["X-Cache-Route-Overhead-Us"]) >= 0


async def test_round_robin_rotates_and_headers_name_the_replica():
    async with engines("a", "b", "c") as stubs, gateway(
        settings(engines_flag(stubs), routing_policy="round_robin")
    ) as (_, url), client() as c:
        seen = []
        for _ in range(6):
            status, headers, body = await post(c, url, {"model": "m", "prompt": "hi"})
            assert status == 200
            assert headers["X-Cache-Route-Reason"] == "ROUND_ROBIN"
            assert headers["X-Cache-Route-Policy"] == "round_robin"
            assert headers["X-Cache-Route-Fallback"] == "false"
            seen.append((headers["X-Cache-Route-Replica"], body["served_by"]))
        assert seen == [("r0", "a"), ("r1", "b"), ("r2", "c")] * 2
        assert [len(s.completions) for s in stubs] == [2, 2, 2]


async def test_chat_completions_path_is_proxied():
    async with engines("a") as stubs, gateway(settings(engines_flag(stubs))) as (_, url), \
            client() as c:
        msgs = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        status, headers, _ = await post(c, url, msgs, path="/v1/chat/completions")
        assert status == 200
        assert stubs[0].completions[0].path == "/v1/chat/completions"
        assert "X-Cache-Route-Prompt-Tokens" not in headers  # no tokenizer: no fingerprint
        assert headers["X-Cache-Route-Reason"] == "HINT_SKIPPED"


async def test_streaming_is_relayed_chunk_by_chunk():
    """The second chunk is only produced after the client saw the first through the gateway."""
    gate = asyncio.Event()
    async with engines("a", stream_gate=gate, stream_chunks=3) as stubs, gateway(
        settings(engines_flag(stubs))
    ) as (_, url), client() as c:
        async with c.post(
            url + "/v1/completions", json={"model": "m", "prompt": [5] * 20, "stream": True}
        ) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            assert r.headers["X-Cache-Route-Replica"] == "r0"
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            assert json.loads(first[len(b"data: "):])["choices"][0]["text"] == "a-0"
            gate.set()
            rest = await asyncio.wait_for(r.content.read(), 5)
        events = [e for e in rest.split(b"\n\n") if e]
        assert [e[len(b"data: "):] for e in events][-1] == b"[DONE]"
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["a-1", "a-2"]


async def test_a_stream_that_breaks_ends_with_an_openai_error_event():
    async with engines("a", break_stream_after=1, stream_chunks=3) as stubs, gateway(
        settings(engines_flag(stubs))
    ) as (_gw, url), client() as c:
        async with c.post(
            url + "/v1/completions", json={"model": "m", "prompt": [5] * 20, "stream": True}
        ) as r:
            assert r.status == 200
            data = await asyncio.wait_for(r.content.read(), 5)
        events = [e for e in data.split(b"\n\n") if e]
        assert json.loads(events[0][6:])["choices"][0]["text"] == "a-0"
        err = json.loads(events[1][6:])["error"]
        assert err["type"] == "server_error" and err["code"] == "bad_gateway"
        assert events[-1] == b"data: [DONE]"
        page = (await (await c.get(url + "/metrics")).read()).decode()
        assert metric_value(
            page, "inferencecache_gateway_upstream_errors_total", replica="r0",
            kind="stream_broken",
        ) == 1


async def test_client_disconnect_mid_stream_does_not_hurt_the_gateway():
    gate = asyncio.Event()
    async with engines("a", stream_gate=gate, stream_chunks=50) as stubs, gateway(
        settings(engines_flag(stubs))
    ) as (gw, url):
        async with client() as c, c.post(
            url + "/v1/completions", json={"model": "m", "prompt": [5] * 20, "stream": True}
        ) as r:
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
        gate.set()
        await wait_until(lambda: gw.pool.engines["r0"].in_flight == 0, 5)
        async with client() as c:
            status, _, _ = await post(c, url, {"model": "m", "prompt": [1]})
            assert status == 200


async def test_models_merges_engines_and_health_endpoints():
    async with engines("a", models=[{"id": "m"}, {"id": "sql", "parent": "m"}]) as a, engines(
        "b", models=[{"id": "m"}, {"id": "other"}]
    ) as b, gateway(settings(engines_flag(a + b))) as (_, url), client() as c:
        async with c.get(url + "/v1/models") as r:
            assert r.status == 200
            payload = await r.json()
        assert payload["object"] == "list"
        assert [m["id"] for m in payload["data"]] == ["m", "other", "sql"]
        assert {m["id"]: m.get("parent") for m in payload["data"]}["sql"] == "m"
        async with c.get(url + "/healthz") as r:
            h = await r.json()
            assert r.status == 200 and h["policy"] == "cache_aware"
            assert {k: v["healthy"] for k, v in h["engines"].items()} == {"r0": True, "r1": True}
        async with c.get(url + "/readyz") as r:
            assert r.status == 200


async def test_metrics_count_requests_by_replica_reason_and_status():
    async with engines("a", "b") as stubs, gateway(
        settings(engines_flag(stubs), routing_policy="round_robin")
    ) as (_, url), client() as c:
        for _ in range(3):
            await post(c, url, {"model": "m", "prompt": [1, 2]})
        await post(c, url, b"{bad")
        async with c.get(url + "/metrics") as r:
            assert r.status == 200
            page = (await r.read()).decode()
        count = metric_value(
            page, "inferencecache_gateway_requests_total", endpoint="completions",
            replica="r0", reason="ROUND_ROBIN", status="200",
        )
        assert count == 2
        assert metric_value(
            page, "inferencecache_gateway_requests_total", replica="none", status="400"
        ) == 1
        assert metric_value(page, "inferencecache_gateway_engine_up", replica="r1") == 1
        assert "inferencecache_gateway_overhead_seconds_bucket" in page
        assert "_created" not in page or "inferencecache_gateway" in page


async def test_engine_error_status_and_body_pass_through():
    async with engines("a", completion_status=400) as stubs, gateway(
        settings(engines_flag(stubs))
    ) as (_, url), client() as c:
        status, headers, body = await post(c, url, {"model": "m", "prompt": [1]})
        assert status == 400
        assert body["error"]["message"] == "engine says no"
        assert headers["X-Cache-Route-Replica"] == "r0"


async def test_query_string_is_forwarded():
    async with engines("a") as stubs, gateway(settings(engines_flag(stubs))) as (_, url), \
            client() as c:
        async with c.post(url + "/v1/completions?trace=1", json={"model": "m", "prompt": "x"}) \
                as r:
            assert r.status == 200
        assert stubs[0].completions[0].path == "/v1/completions"


async def test_gzip_from_engine_passes_through_untouched():
    """auto_decompress is off: the engine's encoded bytes and Content-Encoding reach the client."""
    import gzip

    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            body=gzip.compress(b'{"ok": true}'),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )

    async with raw_engine(handler) as port, \
            gateway(settings(f"r0=http://127.0.0.1:{port}")) as (_, url), \
            aiohttp.ClientSession(auto_decompress=False) as c, c.post(
                url + "/v1/completions", json={"model": "m", "prompt": "x"}
            ) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(await r.read()) == b'{"ok": true}'


async def test_no_cookies_kept_and_no_encoding_asked_on_the_clients_behalf():
    from aiohttp import web

    seen: list[dict[str, str]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        resp = web.json_response({"ok": True})
        resp.set_cookie("session", "secret-of-client-1")
        return resp

    async with raw_engine(handler) as port, \
            gateway(settings(f"r0=http://127.0.0.1:{port}")) as (_, url):
        for _ in range(2):
            async with aiohttp.ClientSession(skip_auto_headers=("Accept-Encoding",)) as c, \
                    c.post(url + "/v1/completions", data=b'{"model": "m", "prompt": "x"}',
                           skip_auto_headers=("Content-Type",)) as r:
                assert r.status == 200
    assert len(seen) == 2
    for h in seen:
        assert "Cookie" not in h  # the first answer's cookie was not replayed for the second
        assert "Accept-Encoding" not in h
        assert h["Content-Type"] == "application/json"
