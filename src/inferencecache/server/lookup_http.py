"""The HTTP lookup listener (``serve --lookup-http-address``): LookupRoute over HTTP/1.1.

- ``POST /v1/lookup``: a ``LookupRouteRequest`` as protobuf bytes (``Content-Type:
  application/x-protobuf``, ``application/protobuf`` or ``application/octet-stream``; answered
  with ``LookupRouteResponse`` bytes) or as JSON (anything else; answered in JSON,
  ``server/lookup_json.py``). Always 200 with the contract's fail-open answers, exactly as the
  gRPC method (an undecodable body is ``NO_HINT``), except 413 for a body over 16 MiB (the
  gRPC receive bound), 401 for a missing or unknown bearer token and 403 for one that may not
  read the request's tenant (``auth.Authorizer``, as the gRPC methods).
- ``POST /query``: the request and answer shape of NVIDIA Dynamo's standalone KV indexer, so its
  clients can point at us (415 without a JSON content type, 400 for a body that is not JSON,
  422 for JSON of another shape, as Dynamo answers).

Every request goes through ``LookupPath.answer``, the code the gRPC method runs, so both
transports give the same answers (tested on thousands of requests).

Why this transport: a trivial gRPC unary call costs ~250-400 µs here in grpcio's Python server
machinery; aiohttp's low-level server on uvloop ~60-80 µs of CPU per request, about half of
Dynamo's indexer's throughput at 32 callers. This listener is an ``asyncio.Protocol`` on uvloop
(compiled event loop) with httptools (compiled llhttp parser, what uvicorn uses) doing all the
HTTP parsing: per request only the callbacks and the lookup run in Python
(docs/benchmarks.md, docs/decisions.md). It runs on its own event loop in one thread; the
index part of a lookup is a few µs under the index lock, so it runs inline; a ``prompt_text``
lookup, which waits for a tokenizer, runs in the default executor, and the connection reads
nothing more until its answer is written (answers stay in request order).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import cast

import httptools

from inferencecache.index.model import LookupRequest
from inferencecache.server import lookup_json, lookup_wire
from inferencecache.server.lookup_path import LookupDenied, LookupPath
from inferencecache.server.settings import MAX_RECEIVE_MESSAGE_BYTES
from inferencecache.web import LoopThread

log = logging.getLogger("inferencecache.server.http")

PROTOBUF_TYPES = frozenset(
    {b"application/x-protobuf", b"application/protobuf", b"application/octet-stream"}
)
_JSON = b"application/json"
_PROTO = b"application/x-protobuf"
_TEXT = b"text/plain"
_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden",
            404: b"Not Found", 405: b"Method Not Allowed", 413: b"Payload Too Large",
            414: b"URI Too Long", 415: b"Unsupported Media Type", 422: b"Unprocessable Entity",
            431: b"Request Header Fields Too Large"}  # fmt: skip
MAX_URL = 8 * 1024
"""Bytes of a request target; longer → 414 and the connection closes (no lookup path is long)."""
MAX_HEADERS = 64 * 1024
"""Bytes of a request's header names and values; more → 431 and the connection closes."""

Answer = tuple[int, bytes, bytes, bytes]
"""(status, content type, body, extra header lines)."""


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; plain asyncio still serves correctly
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _media_type(value: bytes) -> bytes:
    return value.split(b";", 1)[0].strip().lower()


class LookupHttp:
    """Routes, decodes, calls ``LookupPath.answer`` and encodes: one request to one answer."""

    def __init__(self, path: LookupPath) -> None:
        self._answer = path.answer
        self._bad_query = path.count_undecodable
        self.drops = path.drops

    def handle(
        self, method: bytes, route: bytes, ctype: bytes, auth: bytes | None, body: bytes,
        peer: Callable[[], str],
    ) -> Answer | LookupRequest:  # fmt: skip
        """The answer, or (a ``prompt_text`` lookup) the request for ``run_blocking``."""
        if route != b"/v1/lookup" and route != b"/query":
            return 404, _TEXT, b"not found\n", b""
        if method != b"POST":
            return 405, _TEXT, b"method not allowed\n", b"Allow: POST\r\n"
        credentials: Callable[[], str | None] = lambda: (  # noqa: E731
            auth.decode("latin-1") if auth is not None else None
        )
        try:
            if route == b"/query":
                if ctype != _JSON:
                    return (415, _TEXT, b"Expected request with `Content-Type: application/json`",
                            b"")  # fmt: skip
                req = lookup_json.parse_query(body)
                if isinstance(req, tuple):
                    self._bad_query("http:/query", peer)
                    return req[0], _TEXT, req[1].encode(), b""
                if req.prompt_text:
                    return req
                out = self._answer(req, None, lookup_json.encode_dynamo, method="http:/query",
                                   peer=peer, credentials=credentials)  # fmt: skip
                return 200, _JSON, out, b""
            proto = ctype in PROTOBUF_TYPES
            parsed = lookup_wire.parse_lookup_request(body) if proto else \
                lookup_json.parse_request(body)  # fmt: skip
            if isinstance(parsed, LookupRequest) and parsed.prompt_text:
                return parsed
            encode = lookup_wire.encode_response if proto else lookup_json.encode_response
            out = self._answer(parsed, None, encode, method="http:/v1/lookup", peer=peer,
                               credentials=credentials)  # fmt: skip
            return 200, _PROTO if proto else _JSON, out, b""
        except LookupDenied as e:
            return _denied(e)

    def run_blocking(
        self, req: LookupRequest, route: bytes, ctype: bytes, auth: bytes | None,
        peer: Callable[[], str],
    ) -> Answer:  # fmt: skip
        """A lookup that may wait for a tokenizer (called in an executor)."""
        try:
            credentials = lambda: auth.decode("latin-1") if auth is not None else None  # noqa: E731
            if route == b"/query":
                out = self._answer(req, None, lookup_json.encode_dynamo, method="http:/query",
                                   peer=peer, credentials=credentials)  # fmt: skip
                return 200, _JSON, out, b""
            proto = ctype in PROTOBUF_TYPES
            encode = lookup_wire.encode_response if proto else lookup_json.encode_response
            out = self._answer(req, None, encode, method="http:/v1/lookup", peer=peer,
                               credentials=credentials)  # fmt: skip
            return 200, _PROTO if proto else _JSON, out, b""
        except LookupDenied as e:
            return _denied(e)


def _denied(e: LookupDenied) -> Answer:
    if e.unauthenticated:
        return 401, _TEXT, b"unauthorized\n", b"WWW-Authenticate: Bearer\r\n"
    return 403, _TEXT, b"forbidden\n", b""


class _Connection(asyncio.Protocol):
    """One client connection: httptools parses, ``LookupHttp`` answers, in request order."""

    def __init__(self, app: LookupHttp, connections: set[_Connection]) -> None:
        self._app = app
        self._connections = connections
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._ctype = b""
        self._auth: bytes | None = None
        self._body: list[bytes] = []
        self._size = 0
        self._head = 0  # header bytes of the current request
        self._too_large = False
        self._busy = False  # an answer is being computed off the loop
        self._queued: list[tuple[bytes, bytes, bytes, bytes | None, bytes, bool]] = []
        self._closing = False

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self._transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, b"upgrade not supported\n")
        except httptools.HttpParserCallbackError:
            pass  # the callback already answered and closed
        except httptools.HttpParserError:
            self._fail(400, b"malformed HTTP request\n")

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._ctype = b""
        self._auth = None
        self._body = []
        self._size = 0
        self._head = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL:
            self._fail(414, b"request target too long\n")
            raise httptools.HttpParserCallbackError("request target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head += len(name) + len(value)
        if self._head > MAX_HEADERS:
            self._fail(431, b"request headers too large\n")
            raise httptools.HttpParserCallbackError("request headers too large")
        lname = name.lower()
        if lname == b"content-type":
            self._ctype = _media_type(value)
        elif lname == b"authorization":
            self._auth = value
        elif lname == b"expect" and value.lower() == b"100-continue" and self._transport:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_RECEIVE_MESSAGE_BYTES:
            self._too_large = True
            self._body = []
        elif not self._too_large:
            self._body.append(body)

    def on_message_complete(self) -> None:
        keep = self._parser.should_keep_alive()
        if self._too_large:
            self._write((413, _TEXT, b"body larger than 16 MiB\n", b""), False)
            return
        route = self._url.split(b"?", 1)[0]
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        item = (self._parser.get_method(), route, self._ctype, self._auth, body, keep)
        if self._busy:  # a pipelined request behind an answer computed off the loop
            self._queued.append(item)
        else:
            self._serve(*item)

    def _serve(self, method: bytes, route: bytes, ctype: bytes, auth: bytes | None,
               body: bytes, keep: bool) -> None:  # fmt: skip
        try:
            out = self._app.handle(method, route, ctype, auth, body, self._peer)
        except Exception as e:  # LookupPath never raises; a bug here drops this request only
            self._app.drops.drop("http:lookup", e, peer=self._peer())
            self._write((500, _TEXT, b"internal error\n", b""), False)
            return
        if isinstance(out, LookupRequest):
            self._later(out, route, ctype, auth, keep)
        else:
            self._write(out, keep)

    # -- plumbing ------------------------------------------------------------------------------

    def _peer(self) -> str:
        t = self._transport
        info = t.get_extra_info("peername") if t is not None else None
        return f"{info[0]}:{info[1]}" if info else ""

    def _later(self, req: LookupRequest, route: bytes, ctype: bytes, auth: bytes | None,
               keep: bool) -> None:  # fmt: skip
        transport = self._transport
        if transport is None:
            return
        transport.pause_reading()  # answers stay in request order
        self._busy = True
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, self._app.run_blocking, req, route, ctype, auth,
                                   self._peer)  # fmt: skip

        def done(f: asyncio.Future[Answer]) -> None:
            self._busy = False
            try:
                answer = f.result()
            except Exception as e:
                self._app.drops.drop("http:lookup", e, peer=self._peer())
                answer = (500, _TEXT, b"internal error\n", b"")
                keep_ = False
            else:
                keep_ = keep
            self._write(answer, keep_)
            while self._queued and not self._busy and self._transport is not None:
                self._serve(*self._queued.pop(0))
            if self._transport is not None and keep_ and not self._busy:
                self._transport.resume_reading()

        fut.add_done_callback(done)

    def _write(self, answer: Answer, keep: bool) -> None:
        transport = self._transport
        if transport is None:
            return
        status, ctype, body, extra = answer
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s" % (
            status, _REASONS.get(status, b"Error"), ctype, len(body), extra,
        )  # fmt: skip
        if keep and not self._closing:
            transport.write(head + b"\r\n" + body)
        else:
            transport.write(head + b"Connection: close\r\n\r\n" + body)
            transport.close()

    def _fail(self, status: int, text: bytes) -> None:
        self._write((status, _TEXT, text, b""), False)

    def shutdown(self) -> None:
        """Close now when idle, else after the answer being computed."""
        self._closing = True
        if not self._busy and self._transport is not None:
            self._transport.close()


class LookupHttpServer(LoopThread):
    """Serves ``LookupHttp`` on a pre-bound socket from its own thread and uvloop loop."""

    _thread_name = "lookup-http"
    _what = "HTTP lookup listener"

    def __init__(self, sock: socket.socket, path: LookupPath) -> None:
        super().__init__()
        self._sock = sock
        self._app = LookupHttp(path)
        self._connections: set[_Connection] = set()
        self._listener: asyncio.AbstractServer | None = None

    def _new_loop(self) -> asyncio.AbstractEventLoop:
        return _new_loop()

    async def _setup(self) -> None:
        loop = asyncio.get_running_loop()
        app, conns = self._app, self._connections
        self._listener = await loop.create_server(
            lambda: _Connection(app, conns), sock=self._sock, backlog=512
        )

    async def _cleanup(self) -> None:
        try:
            if self._listener is not None:
                self._listener.close()
            for conn in list(self._connections):
                conn.shutdown()
            for _ in range(50):  # in-flight prompt_text answers: bounded wait
                if not self._connections:
                    break
                await asyncio.sleep(0.1)
        except Exception:
            log.exception("HTTP lookup listener cleanup failed")


__all__ = ["LookupHttp", "LookupHttpServer"]
