"""Test doubles and helpers for the gateway tests: small real HTTP engines on loopback.

``StubEngine`` is a real aiohttp server on 127.0.0.1 (port chosen by the OS) speaking the
OpenAI completions shape, streaming or not, recording every request it receives. Behaviour
knobs let a test make it slow, failing, or break a stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from inferencecache import fingerprint
from inferencecache.gateway.app import Gateway
from inferencecache.gateway.settings import GatewaySettings
from inferencecache.tokenize.openai import EngineTokenizer
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.web import Listener

LOOPBACK = "127.0.0.1"


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class StubEngine:
    """An OpenAI-shaped engine double. Start with ``await e.start()``; stop with ``e.stop()``."""

    name: str
    models: list[dict[str, Any]] = field(default_factory=lambda: [{"id": "m"}])
    health_status: int = 200
    completion_status: int = 200
    delay: float = 0.0  # before answering a completion
    stream_chunks: int = 3
    stream_gate: asyncio.Event | None = None  # chunk 2.. wait for it
    break_stream_after: int | None = None  # drop the connection after n chunks
    oracle_tokens: int | None = None  # /debug/cache/match answer (None: 404)
    received: list[Received] = field(default_factory=list)
    oracle_queries: list[Any] = field(default_factory=list)
    health_probes: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def completions(self) -> list[Received]:
        return [r for r in self.received if r.path.startswith("/v1/")]

    async def start(self, port: int = 0) -> StubEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/debug/cache/match", self._oracle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(64)
        sock.setblocking(False)
        await web.SockSite(self._runner, sock).start()
        self.port = sock.getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.StreamResponse:
        self.health_probes += 1
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": self.models})

    async def _oracle(self, request: web.Request) -> web.StreamResponse:
        self.oracle_queries.append(await request.json())
        if self.oracle_tokens is None:
            return web.Response(status=404)
        return web.json_response({"matched_tokens": self.oracle_tokens})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k.title(): v for k, v in request.headers.items()}
        self.received.append(Received(request.path, headers, body))
        if self.delay:
            await asyncio.sleep(self.delay)
        data = json.loads(body)
        if self.completion_status != 200:
            return web.json_response(
                {"error": {"message": "engine says no", "type": "x", "param": None, "code": 1}},
                status=self.completion_status,
            )
        if not data.get("stream"):
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": data.get("model"),
                    "choices": [{"index": 0, "text": f"from {self.name}", "finish_reason": "stop"}],
                    "served_by": self.name,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.stream_chunks):
            if i > 0 and self.stream_gate is not None:
                await self.stream_gate.wait()
            if self.break_stream_after is not None and i >= self.break_stream_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            chunk = {"choices": [{"index": 0, "text": f"{self.name}-{i}"}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@asynccontextmanager
async def engines(*names: str, **kwargs: Any) -> AsyncIterator[list[StubEngine]]:
    started = [await StubEngine(n, **kwargs).start() for n in names]
    try:
        yield started
    finally:
        for e in started:
            await e.stop()


def engines_flag(stubs: Sequence[StubEngine], ids: Sequence[str] | None = None) -> str:
    ids = ids or [f"r{i}" for i in range(len(stubs))]
    return ",".join(f"{rid}={s.url}" for rid, s in zip(ids, stubs, strict=True))


def dead_url() -> str:
    """A loopback URL nothing listens on (bound then closed: connection refused)."""
    s = socket.socket()
    s.bind((LOOPBACK, 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://{LOOPBACK}:{port}"


def settings(engines: str, **kwargs: Any) -> GatewaySettings:
    base: dict[str, Any] = {
        "engines": engines,
        "server": _dead_server(),
        "health_interval": 0.2,
        "health_timeout": 0.5,
        "health_backoff_max": 0.4,
        "lookup_timeout": 1.0,  # generous: tests must not flake on a slow CI machine
    }
    base.update(kwargs)
    return GatewaySettings(**base)


def _dead_server() -> Any:
    from inferencecache.config import HostPort

    s = socket.socket()
    s.bind((LOOPBACK, 0))
    port = s.getsockname()[1]
    s.close()
    return HostPort(LOOPBACK, port)


def host_port(target: str) -> Any:
    from inferencecache.config import parse_host_port

    return parse_host_port(target)


@asynccontextmanager
async def gateway(
    gw_settings: GatewaySettings, tokenizers: dict[str, EngineTokenizer] | None = None
) -> AsyncIterator[tuple[Gateway, str]]:
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    sock.listen(64)
    sock.setblocking(False)
    gw = Gateway(gw_settings, tokenizers=tokenizers)
    try:
        await gw.start(sock)
        yield gw, f"http://{LOOPBACK}:{gw.port}"
    finally:
        await gw.stop()
        sock.close()


@asynccontextmanager
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        yield s


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: Any,
    *,
    path: str = "/v1/completions",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(
        url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        raw = await r.read()
        try:
            payload: Any = json.loads(raw)
        except ValueError:
            payload = raw
        return r.status, dict(r.headers), payload


async def wait_until(pred: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)


def report(
    replica: str,
    tokens: Sequence[int],
    *,
    tenant: str = "default",
    model: str = "m",
    adapter: str = "",
    block: int = 16,
) -> pb.CacheStateUpdate:
    """What a subscriber reports after ``replica`` cached ``tokens`` (one chain entry)."""
    hashes, counts = fingerprint.chain(list(tokens), block)
    return pb.CacheStateUpdate(
        replica_id=replica,
        model_id=model,
        tenant_id=tenant,
        hash_scheme="vllm",
        prefixes=[
            pb.PrefixEntry(
                block_hashes=hashes,
                block_token_counts=counts,
                tier=pb.CACHE_TIER_T1,
                adapter_id=adapter,
            )
        ],
    )


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if "{" in head:
            metric, _, rest = head.partition("{")
            got = dict(
                part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part
            )
            got = {k: v.strip('"') for k, v in got.items()}
        else:
            metric, got = head, {}
        if metric == name and all(got.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0


@asynccontextmanager
async def raw_engine(
    completions: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[int]:
    """An engine whose ``POST /v1/completions`` is ``completions`` (``/health`` answers 200),
    on a loopback port chosen by the OS; yields the port."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    listener = Listener(app)
    port = await listener.start(LOOPBACK, 0)
    try:
        yield port
    finally:
        await listener.stop()
