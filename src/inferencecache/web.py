"""What the aiohttp listeners here share: bounded body reads, and one app served on one TCP
address whose bound port is known (port 0 picks a free one).

:func:`bind_tcp` binds a listening socket up front and turns a failure into one
:class:`ListenError` line naming the flag and the address (exit 2 in every command).

Used by the server's HTTP surfaces, the gateway, the subscriber's metrics listener and the fake
and simulated engines, so a body limit or a bind behaves the same in each.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

from aiohttp import web

from inferencecache.config import HostPort
from inferencecache.supervise import Drops


class ListenError(Exception):
    """A listener could not be bound; the message is one line naming the address."""


def bind_tcp(flag: str, addr: HostPort, backlog: int = 512) -> socket.socket:
    """A listening TCP socket for ``addr`` (empty host = every interface)."""
    host = addr.host or None
    try:
        infos = socket.getaddrinfo(
            host, addr.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as e:
        raise ListenError(f"cannot listen on {flag} {addr}: {e.strerror or e}") from e
    if host is None:  # prefer a dual-stack wildcard
        infos.sort(key=lambda i: i[0] != socket.AF_INET6)
    last: OSError | None = None
    for family, socktype, proto, _, sockaddr in infos:
        sock = socket.socket(family, socktype, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and host is None:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(sockaddr)
            sock.listen(backlog)
            sock.setblocking(False)
            return sock
        except OSError as e:
            sock.close()
            last = e
    reason = (last.strerror if last is not None else None) or "no usable address"
    raise ListenError(f"cannot listen on {flag} {addr}: {reason}")


async def read_limited(request: web.Request, limit: int) -> bytes | None:
    """The request body, or None when it is larger than ``limit`` bytes (checked against the
    declared length first, then while reading, so a large body is never held whole)."""
    if request.content_length is not None and request.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def guard_middleware(drops: Drops, loop: str = "http") -> Any:
    """aiohttp middleware: a request whose handler raises unexpectedly is answered 500 and
    counted in ``drops`` under ``loop`` (logged rate-limited), instead of aiohttp's traceback
    per request. HTTP errors raised on purpose (``web.HTTPException``) pass through."""

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except web.HTTPException:
            raise
        except Exception as e:
            reason = drops.drop(loop, e, path=request.path[:200], method=request.method)
            return web.Response(
                status=500, text=f"internal error ({reason}); request dropped\n",
                content_type="text/plain",
            )

    return guard


class Listener:
    """One app served on one TCP address from the caller's event loop."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind and serve (``host`` "" = every interface); returns the bound port. A bind error
        (OSError) leaves nothing running."""
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host or None, port, reuse_address=True)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        addresses = runner.addresses
        self.port = int(addresses[0][1]) if addresses else port
        return self.port

    async def start_socket(self, sock: socket.socket) -> int:
        """Serve on an already bound listening socket (see :func:`bind_tcp`, which reports bind
        errors before anything starts); returns its port."""
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(sock.getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class LoopThread:
    """A server that runs its own event loop on a daemon thread: ``start`` returns once
    ``_setup`` has run there (re-raising its failure), ``stop`` stops the loop and joins, and
    ``_cleanup`` runs on the loop before it closes. Subclasses give the loop (``_new_loop``)
    and the two coroutines."""

    _thread_name = "loop"
    _what = "server"

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def _new_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.new_event_loop()

    async def _setup(self) -> None:
        raise NotImplementedError

    async def _cleanup(self) -> None:
        raise NotImplementedError

    def start(self, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"{self._what} did not start in time")
        if self._error is not None:
            raise RuntimeError(f"{self._what} failed to start: {self._error}") from self._error

    def _run(self) -> None:
        loop = self._new_loop()
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

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, finish in-flight requests (bounded), close the loop."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
