"""The HTTP lookup listener (``serve --lookup-http-address``): LookupRoute over HTTP/1.1.

- ``POST /v1/lookup``: a ``LookupRouteRequest`` as protobuf bytes (``Content-Type:
  application/x-protobuf``, ``application/protobuf`` or ``application/octet-stream``; answered
  with ``LookupRouteResponse`` bytes) or as JSON (anything else; answered in JSON,
  ``server/lookup_json.py``). Always 200 with the contract's fail-open answers, exactly as the
  gRPC method (an undecodable body is ``NO_HINT``), except 413 for a body over 16 MiB (the
  gRPC receive bound) and 401 when the lookup auth check refuses the caller.
- ``POST /query``: the request and answer shape of NVIDIA Dynamo's standalone KV indexer, so its
  clients can point at us (400 for a body that is not JSON, 422 for a JSON body of another
  shape, as Dynamo answers).

Why a listener of its own: a trivial gRPC unary call costs ~250-400 µs here in grpcio's Python
server machinery, an HTTP/1.1 request on aiohttp's low-level server (C parser) on uvloop
~60-80 µs (docs/benchmarks.md). Every request goes through ``LookupPath.answer``, the code
the gRPC method runs, so both transports give the same answers (tested on thousands of
requests). It runs on its own uvloop event loop in one thread; the index part of a lookup is a
few µs under the index lock, so it runs inline on the loop; a ``prompt_text`` lookup, which
waits for a tokenizer, runs in the default executor.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

from aiohttp import web
from aiohttp.web_exceptions import HTTPRequestEntityTooLarge

from inferencecache.index.model import LookupRequest, LookupResult
from inferencecache.server import lookup_json, lookup_wire
from inferencecache.server.lookup_path import LookupDenied, LookupPath
from inferencecache.server.settings import MAX_RECEIVE_MESSAGE_BYTES

log = logging.getLogger("inferencecache.server.http")

PROTOBUF_TYPES = frozenset(
    {"application/x-protobuf", "application/protobuf", "application/octet-stream"}
)
_JSON = "application/json"
_PROTO = "application/x-protobuf"


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; plain asyncio still serves correctly
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _response(status: int, body: bytes, content_type: str) -> web.Response:
    return web.Response(status=status, body=body, content_type=content_type)


class LookupHttp:
    """The request handler: routes by path, decodes, calls ``LookupPath.answer``, encodes."""

    def __init__(self, path: LookupPath) -> None:
        self._answer = path.answer
        self._bad_query = path.count_undecodable

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        route = request.path
        if route != "/v1/lookup" and route != "/query":
            return _response(404, b"not found\n", "text/plain")
        if request.method != "POST":
            return web.Response(status=405, text="method not allowed\n", headers={"Allow": "POST"})
        try:
            body = await request.read()
        except HTTPRequestEntityTooLarge:
            return _response(413, b"body larger than 16 MiB\n", "text/plain")
        headers = request.headers
        try:
            if route == "/query":
                return await self._query(body, headers, request)
            if request.content_type in PROTOBUF_TYPES:
                req: LookupRequest | lookup_wire._Undecodable = (
                    lookup_wire.parse_lookup_request(body)
                )
                out = await self._run(req, lookup_wire.encode_response, request, "http:/v1/lookup")
                return _response(200, out, _PROTO)
            req = lookup_json.parse_request(body)
            out = await self._run(req, lookup_json.encode_response, request, "http:/v1/lookup")
            return _response(200, out, _JSON)
        except LookupDenied:
            return web.Response(
                status=401, text="unauthorized\n", headers={"WWW-Authenticate": "Bearer"}
            )

    async def _query(self, body: bytes, headers: Any, request: web.BaseRequest) -> web.Response:
        if request.content_type != _JSON:
            return _response(415, b"Expected request with `Content-Type: application/json`",
                             "text/plain")  # fmt: skip
        req = lookup_json.parse_query(body)
        if isinstance(req, tuple):
            status, reason = req
            self._bad_query(method="http:/query")
            return _response(status, reason.encode(), "text/plain")
        out = await self._run(req, lookup_json.encode_dynamo, request, "http:/query")
        return _response(200, out, _JSON)

    async def _run(
        self,
        req: LookupRequest | lookup_wire._Undecodable,
        encode: Any,
        request: web.BaseRequest,
        method: str,
    ) -> bytes:
        def peer() -> str:
            return request.remote or ""

        def credentials() -> str | None:
            return request.headers.get("Authorization")

        if isinstance(req, LookupRequest) and req.prompt_text:
            # waits for a tokenizer (bounded by the pipeline's deadline): off the loop
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                None, lambda: self._answer(req, None, encode, method=method, peer=peer,
                                           credentials=credentials))  # fmt: skip
        out: bytes = self._answer(req, None, encode, method=method, peer=peer,
                                  credentials=credentials)  # fmt: skip
        return out


def _request_factory(server: web.Server) -> Any:
    def make(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        return web.BaseRequest(
            message, payload, protocol, writer, task, server._loop,
            client_max_size=MAX_RECEIVE_MESSAGE_BYTES,
        )  # fmt: skip

    return make


class LookupHttpServer:
    """Serves ``LookupHttp`` on a pre-bound socket from its own thread and uvloop loop."""

    def __init__(self, sock: socket.socket, path: LookupPath) -> None:
        self._sock = sock
        self._handler = LookupHttp(path)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._server: web.Server | None = None
        self._listener: asyncio.AbstractServer | None = None

    def start(self, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="lookup-http", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("HTTP lookup listener did not start in time")
        if self._error is not None:
            raise RuntimeError(f"HTTP lookup listener failed: {self._error}") from self._error

    def _run(self) -> None:
        loop = _new_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as e:  # reported to start()
            self._error = e
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._cleanup())
            loop.close()

    async def _setup(self) -> None:
        server = web.Server(self._handler, access_log=None)
        server.request_factory = _request_factory(server)
        self._server = server
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(server, sock=self._sock, backlog=512)

    async def _cleanup(self) -> None:
        try:
            if self._listener is not None:
                self._listener.close()
            if self._server is not None:
                await self._server.shutdown(5.0)
        except Exception:
            log.exception("HTTP lookup listener cleanup failed")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, finish in-flight requests (bounded), close the loop."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)


__all__ = ["LookupHttp", "LookupHttpServer", "LookupResult"]
