"""Malformed client requests get OpenAI-style error JSON and the right status; nothing crashes."""

from __future__ import annotations

import pytest

from tests.gateway.support import (
    client,
    dead_url,
    engines,
    engines_flag,
    gateway,
    metric_value,
    post,
    settings,
)


def assert_openai_error(body, code, status_type="invalid_request_error", param="__any__"):
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == status_type
    assert err["code"] == code
    if param != "__any__":
        assert err["param"] == param


BAD = [
    (b"{not json", 400, "invalid_json", None, "/v1/completions"),
    (b"\xff\xfe", 400, "invalid_json", None, "/v1/completions"),
    (b"[1, 2]", 400, "invalid_request", None, "/v1/completions"),
    (b'{"prompt": "x"}', 400, "missing_field", "model", "/v1/completions"),
    (b'{"model": 7, "prompt": "x"}', 400, "missing_field", "model", "/v1/completions"),
    (b'{"model": "m"}', 400, "missing_field", "prompt", "/v1/completions"),
    (b'{"model": "m", "prompt": 5}', 400, "invalid_field", "prompt", "/v1/completions"),
    (b'{"model": "m", "prompt": []}', 400, "invalid_field", "prompt", "/v1/completions"),
    (b'{"model": "m", "prompt": [1, -1]}', 400, "invalid_field", "prompt", "/v1/completions"),
    (b'{"model": "m", "prompt": [1, 4294967296]}', 400, "invalid_field", "prompt",
     "/v1/completions"),
    (b'{"model": "m", "prompt": [1, true]}', 400, "invalid_field", "prompt", "/v1/completions"),
    (b'{"model": "m", "prompt": ["a", [1]]}', 400, "invalid_field", "prompt", "/v1/completions"),
    (b'{"model": "m"}', 400, "missing_field", "messages", "/v1/chat/completions"),
    (b'{"model": "m", "messages": []}', 400, "invalid_field", "messages",
     "/v1/chat/completions"),
    (b'{"model": "m", "messages": ["hi"]}', 400, "invalid_field", "messages",
     "/v1/chat/completions"),
    (b'{"model": "m", "messages": [{"content": "x"}]}', 400, "invalid_field", "messages",
     "/v1/chat/completions"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', 400, "invalid_field",
     "messages", "/v1/chat/completions"),
    (b'{"model": "nope", "prompt": "x"}', 404, "model_not_found", "model", "/v1/completions"),
]


@pytest.mark.parametrize(("raw", "status", "code", "param", "path"), BAD)
async def test_malformed_requests_get_openai_errors(raw, status, code, param, path):
    async with engines("a") as stubs, gateway(settings(engines_flag(stubs))) as (_, url), \
            client() as c:
        got_status, _, body = await post(c, url, raw, path=path)
        assert got_status == status
        assert_openai_error(body, code, param=param)
        assert stubs[0].completions == []  # never forwarded
        # the gateway keeps serving
        ok, _, _ = await post(c, url, {"model": "m", "prompt": [1, 2]})
        assert ok == 200


async def test_unknown_path_and_wrong_method():
    async with engines("a") as stubs, gateway(settings(engines_flag(stubs))) as (_, url), \
            client() as c:
        async with c.get(url + "/v1/embeddings") as r:
            assert r.status == 404
            assert_openai_error(await r.json(), "not_found")
        async with c.get(url + "/v1/completions") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert_openai_error(await r.json(), "method_not_allowed")
        async with c.post(url + "/v1/models") as r:
            assert r.status == 405
            assert_openai_error(await r.json(), "method_not_allowed")
        async with c.delete(url + "/metrics") as r:
            assert r.status == 405


async def test_huge_body_is_413_by_header_and_by_stream():
    async with engines("a") as stubs, gateway(
        settings(engines_flag(stubs), max_body_bytes=2048)
    ) as (_gw, url), client() as c:
        big = b'{"model": "m", "prompt": "' + b"x" * 4096 + b'"}'
        status, _, body = await post(c, url, big)
        assert status == 413
        assert_openai_error(body, "request_too_large")

        async def chunks():
            for _ in range(8):
                yield b"x" * 1024

        async with c.post(url + "/v1/completions", data=chunks()) as r:  # chunked: no length
            assert r.status == 413
            assert_openai_error(await r.json(), "request_too_large")
        page = (await (await c.get(url + "/metrics")).read()).decode()
        assert metric_value(
            page, "inferencecache_gateway_bad_requests_total", code="request_too_large"
        ) == 2
        assert stubs[0].completions == []


async def test_all_engines_down_is_503():
    async with gateway(settings(f"r0={dead_url()},r1={dead_url()}")) as (_, url), client() as c:
        status, _, body = await post(c, url, {"model": "m", "prompt": [1, 2]})
        assert status == 503
        assert_openai_error(body, "no_healthy_engine", status_type="server_error")
        async with c.get(url + "/readyz") as r:
            assert r.status == 503
        async with c.get(url + "/v1/models") as r:
            assert r.status == 503
            assert_openai_error(await r.json(), "no_healthy_engine", status_type="server_error")


async def test_engine_silent_past_upstream_timeout_is_504():
    async with engines("a", delay=2.0) as stubs, gateway(
        settings(engines_flag(stubs), upstream_timeout=0.2)
    ) as (_, url), client() as c:
        status, headers, body = await post(c, url, {"model": "m", "prompt": [1]})
        assert status == 504
        assert_openai_error(body, "upstream_timeout", status_type="server_error")
        assert headers["X-Cache-Route-Replica"] == "r0"


async def test_unknown_model_passes_through_before_any_discovery():
    """Without /v1/models data the gateway cannot know the model list: let the engine decide."""
    async with engines("a") as stubs, gateway(
        settings(engines_flag(stubs), discover_models=False)
    ) as (_, url), client() as c:
        status, _, _ = await post(c, url, {"model": "whatever", "prompt": [1]})
        assert status == 200
        assert stubs[0].completions[0].json["model"] == "whatever"


async def test_engine_that_cuts_a_complete_answer_short_is_502():
    """A raw engine announcing 1000 bytes, sending 10 and hanging up."""
    import asyncio

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        if length:
            await reader.readexactly(length)
        if head.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"partial\"")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with gateway(settings(f"r0=http://127.0.0.1:{port}")) as (_, url), \
                client() as c:
            status, headers, body = await post(c, url, {"model": "m", "prompt": [1]})
            assert status == 502
            assert_openai_error(body, "bad_gateway", status_type="server_error")
            assert headers["X-Cache-Route-Replica"] == "r0"
            page = (await (await c.get(url + "/metrics")).read()).decode()
            assert metric_value(
                page, "inferencecache_gateway_requests_total", replica="r0", status="502"
            ) == 1
    finally:
        server.close()
        await server.wait_closed()
