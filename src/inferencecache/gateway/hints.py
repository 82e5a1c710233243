"""The LookupRoute clients: a short deadline, and never an exception.

Three sources, the same request and answer: ``HttpHintClient`` POSTs the ``LookupRouteRequest``
bytes to the server's HTTP lookup listener (``serve --lookup-http-address``) over a keep-alive
connection pool, ``HintClient`` calls the gRPC method on one ``grpc.aio`` channel. The HTTP path
is the cheaper one on both sides (docs/gateway.md has the figures), so the gateway uses it
whenever ``--lookup-url`` is set; ``ReplicaHintClient`` (``--event-log``) answers from a replica
of the event log held in this process, no hop at all. Every outcome becomes a ``routing.Hint``:
the server's reason code and ranked replicas, or a gateway-side code (``HINT_TIMEOUT`` when our
deadline passed, ``HINT_ERROR`` for any other failure), so the policy falls back and the
request goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import grpc
import grpc.aio

from inferencecache import fingerprint
from inferencecache.channels import PLAINTEXT, ChannelSecurity, FollowedChannel
from inferencecache.routing import reasons
from inferencecache.routing.model import Hint
from inferencecache.server.settings import MAX_RECEIVE_MESSAGE_BYTES, MAX_SEND_MESSAGE_BYTES
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

log = logging.getLogger("inferencecache.gateway")

CHANNEL_OPTIONS: Final[list[tuple[str, Any]]] = [
    # A restarted server is seen again within a second.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.client_idle_timeout_ms", 2**31 - 1),
    ("grpc.max_send_message_length", MAX_RECEIVE_MESSAGE_BYTES),  # what the server accepts
    ("grpc.max_receive_message_length", MAX_SEND_MESSAGE_BYTES),  # what the server sends
]
ERROR_LOG_INTERVAL: Final = 10.0


def chain_request(
    tenant: str, model: str, scheme: str, adapter: str, chain: bytes, block_size: int
) -> pb.LookupRouteRequest:
    """The LookupRouteRequest of a packed fingerprint chain (every block ``block_size``)."""
    n = len(chain) // fingerprint.HASH_BYTES
    return pb.LookupRouteRequest(
        model_id=model,
        tenant_id=tenant,
        hash_scheme=scheme,
        adapter_id=adapter,
        block_hashes=fingerprint.split_packed(chain),
        block_token_counts=[block_size] * n,
    )


def hint_of(resp: Any, elapsed: float) -> Hint:
    """A LookupRouteResponse (or the index's ``LookupResult``, same fields) as a ``Hint``."""
    scores = resp.replica_scores
    return Hint(
        resp.reason_code,
        tuple(s.replica_id for s in scores),
        elapsed,
        tuple(s.matched_tokens for s in scores),
    )


class Hints(Protocol):
    """What the gateway needs of a hint client (either transport)."""

    target: str

    async def start(self, connect_wait: float = 1.0) -> bool: ...
    async def close(self) -> None: ...
    async def lookup(self, tenant: str, model: str, adapter: str, chain: bytes) -> Hint: ...


class _ErrorLog:
    def __init__(self, target: str) -> None:
        self.target = target
        self._last = 0.0

    def __call__(self, err: str) -> None:
        now = time.monotonic()
        if now - self._last >= ERROR_LOG_INTERVAL:
            self._last = now
            log.warning(
                "LookupRoute failed; routing without a hint (logged at most every 10s)",
                extra={"server": self.target, "err": err},
            )


class _Conn:
    """One keep-alive HTTP/1.1 connection to the lookup listener."""

    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class HttpHintClient:
    """Asks LookupRoute over the server's HTTP lookup listener (``POST /v1/lookup`` with the
    ``LookupRouteRequest`` bytes) on a pool of keep-alive connections.

    Why not an HTTP client library: this path only ever talks to our own listener, whose
    answers always carry ``Content-Length`` (never chunked), and aiohttp's client costs ~300 µs
    per request here against ~110-190 µs for a request written and read over asyncio streams
    (docs/gateway.md). Anything else in an answer (another status, a missing length, a closed
    connection, our deadline) drops that connection and is a ``HINT_ERROR`` / ``HINT_TIMEOUT``.
    """

    MAX_IDLE = 64
    MAX_HEAD = 16 * 1024
    MAX_BODY = 16 * 1024 * 1024

    def __init__(
        self,
        url: str,
        timeout: float,
        hash_scheme: str,
        block_size: int,
        security: ChannelSecurity = PLAINTEXT,
    ) -> None:
        self.security = security
        self._auth_head: tuple[str | None, bytes] = (None, b"")
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.target = f"http://{self.host}:{self.port}/v1/lookup"
        self.timeout = timeout
        self.hash_scheme = hash_scheme
        self.block_size = block_size
        self._idle: list[_Conn] = []
        self._log_error = _ErrorLog(self.target)
        self._head = (
            f"POST /v1/lookup HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Content-Type: application/x-protobuf\r\nContent-Length: "
        ).encode()

    async def start(self, connect_wait: float = 1.0) -> bool:
        """Open one connection (kept for the first lookup); False when the listener is not
        reachable within ``connect_wait`` (lookups keep trying)."""
        try:
            async with asyncio.timeout(connect_wait):
                conn = await self._connect()
        except (TimeoutError, OSError):
            return False
        self._idle.append(conn)
        return True

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def _connect(self) -> _Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        return _Conn(reader, writer)

    async def _post(self, body: bytes) -> bytes:
        conn = self._idle.pop() if self._idle else await self._connect()
        try:
            conn.writer.write(self._head + b"%d\r\n%s\r\n" % (len(body), self._auth()) + body)
            head = await conn.reader.readuntil(b"\r\n\r\n")
            if head.startswith((b"HTTP/1.1 401 ", b"HTTP/1.1 403 ")):
                raise PermissionError(f"answer {head[:22]!r}: the server refused the gateway's "
                                      "credential, so no hint (check --auth-token-file and the "
                                      "credential's tenants)")  # fmt: skip
            if len(head) > self.MAX_HEAD or not head.startswith(b"HTTP/1.1 200 "):
                raise RuntimeError(f"answer {head[:40]!r}")
            length = -1
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if not 0 <= length <= self.MAX_BODY:
                raise RuntimeError("answer without a usable Content-Length")
            raw = await conn.reader.readexactly(length)
        except BaseException:
            conn.close()  # an answer half read: this connection is out of step
            raise
        if len(self._idle) < self.MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()
        return raw

    def _auth(self) -> bytes:
        """The ``Authorization`` header line (empty without a token), rebuilt on rotation."""
        auth = self.security.authorization()
        if auth != self._auth_head[0]:
            line = f"Authorization: {auth}\r\n".encode() if auth is not None else b""
            self._auth_head = (auth, line)
        return self._auth_head[1]

    async def lookup(self, tenant: str, model: str, adapter: str, chain: bytes) -> Hint:
        """One LookupRoute; ``latency_s`` is the round trip as this process saw it."""
        body = chain_request(
            tenant, model, self.hash_scheme, adapter, chain, self.block_size
        ).SerializeToString()
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                raw = await self._post(body)
            resp = pb.LookupRouteResponse.FromString(raw)
        except TimeoutError:
            return Hint(reasons.HINT_TIMEOUT, latency_s=time.perf_counter() - t0)
        except Exception as e:  # never fail a request because of the hint plane
            elapsed = time.perf_counter() - t0
            self._log_error(f"{type(e).__name__}: {e}")
            return Hint(reasons.HINT_ERROR, latency_s=elapsed)
        return hint_of(resp, time.perf_counter() - t0)


_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class HintClient:
    """Asks LookupRoute over gRPC with the gateway's own fingerprint chain."""

    def __init__(
        self,
        target: str,
        timeout: float,
        hash_scheme: str,
        block_size: int,
        security: ChannelSecurity = PLAINTEXT,
    ) -> None:
        self.target = target
        self.security = security
        self.timeout = timeout
        self.hash_scheme = hash_scheme
        self.block_size = block_size
        self._channel: grpc.aio.Channel | None = None
        self._followed: FollowedChannel | None = None
        self._call: Any = None
        self._log_error = _ErrorLog(target)

    async def start(self, connect_wait: float = 1.0) -> bool:
        """Open the channel and wait up to ``connect_wait`` for it to connect or fail.

        Returns True when connected. A refused connection returns at once (the first requests
        then fall back while the channel keeps retrying in the background).
        """
        self._followed = FollowedChannel(self.target, self.security, CHANNEL_OPTIONS,
                                         grace=self.timeout)  # fmt: skip
        self._channel = self._followed.channel
        stub = pb_grpc.InferenceCacheStub(self._channel)  # type: ignore[no-untyped-call]
        self._call = stub.LookupRoute
        deadline = time.monotonic() + connect_wait
        channel = self._channel
        while True:
            state = channel.get_state(try_to_connect=True)
            if state == grpc.ChannelConnectivity.READY:
                return True
            if state in (
                grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                grpc.ChannelConnectivity.SHUTDOWN,
            ):
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                async with asyncio.timeout(remaining):
                    await channel.wait_for_state_change(state)
            except TimeoutError:
                return False

    def _rebind(self, followed: FollowedChannel) -> None:
        self._channel = followed.channel
        stub = pb_grpc.InferenceCacheStub(self._channel)  # type: ignore[no-untyped-call]
        self._call = stub.LookupRoute

    async def close(self) -> None:
        if self._followed is not None:
            await self._followed.close()
            self._followed = self._channel = None

    async def lookup(self, tenant: str, model: str, adapter: str, chain: bytes) -> Hint:
        """One LookupRoute; ``latency_s`` is the round trip as this process saw it."""
        req = chain_request(tenant, model, self.hash_scheme, adapter, chain, self.block_size)
        t0 = time.perf_counter()
        try:
            followed = self._followed
            if followed is not None and followed.current() is not self._channel:
                self._rebind(followed)  # renewed TLS files: a new channel
            resp = await self._call(req, timeout=self.timeout, metadata=self.security.metadata())
        except grpc.aio.AioRpcError as e:
            elapsed = time.perf_counter() - t0
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return Hint(reasons.HINT_TIMEOUT, latency_s=elapsed)
            if e.code() in _REFUSED:
                self._log_error(f"{e.code().name}: {e.details()} (the server refused the "
                                "gateway's credential, so no hint: check --auth-token-file, "
                                "the TLS flags and the credential's tenants)")  # fmt: skip
                return Hint(reasons.HINT_ERROR, latency_s=elapsed)
            self._log_error(f"{e.code().name}: {e.details()}")
            return Hint(reasons.HINT_ERROR, latency_s=elapsed)
        except Exception as e:  # never fail a request because of the hint plane
            elapsed = time.perf_counter() - t0
            self._log_error(f"{type(e).__name__}: {e}")
            return Hint(reasons.HINT_ERROR, latency_s=elapsed)
        return hint_of(resp, time.perf_counter() - t0)


class ReplicaHintClient:
    """The same answers from a replica of the event log held in this process
    (``gateway --event-log``): ``Router.lookup`` runs on the event loop's thread (tens of
    microseconds), no gRPC hop. Until the replica has caught up its hints may miss (fail-open,
    like a server that is not ready)."""

    def __init__(self, url: str, key_prefix: str, hash_scheme: str, block_size: int) -> None:
        from inferencecache.eventlog import EventLogConfig
        from inferencecache.eventlog.redislog import redact

        self.hash_scheme = hash_scheme
        self.block_size = block_size
        self.config = EventLogConfig(url, key_prefix=key_prefix)
        self.target = f"in-process replica of {redact(url)}"
        self.replica: Any = None
        self._counts: dict[int, bytes] = {}
        self._log_error = _ErrorLog(self.target)

    def _start_replica(self) -> Any:
        """The replica, with the index settings the servers published (so it holds exactly
        their state), else ``serve``'s defaults with this block size."""
        from inferencecache.eventlog import Replica
        from inferencecache.eventlog.replica import published_settings
        from inferencecache.index import IndexSettings

        settings = published_settings(self.config)
        if settings is None:
            settings = IndexSettings(engine_block_size=self.block_size)
        elif settings.engine_block_size != self.block_size:
            log.warning("the servers' block size differs from --block-size; hints will miss",
                        extra={"servers": settings.engine_block_size,
                               "block_size": self.block_size})
        return Replica(self.config, settings=settings).start()

    async def start(self, connect_wait: float = 1.0) -> bool:
        loop = asyncio.get_running_loop()
        self.replica = await loop.run_in_executor(None, self._start_replica)
        return await loop.run_in_executor(None, self.replica.wait_ready, connect_wait)

    async def close(self) -> None:
        if self.replica is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.replica.close)
            self.replica = None

    async def lookup(self, tenant: str, model: str, adapter: str, chain: bytes) -> Hint:
        from inferencecache.index import LookupRequest

        n = len(chain) // fingerprint.HASH_BYTES
        counts = self._counts.get(n)
        if counts is None:
            counts = bytes((self.block_size,)) * n if self.block_size < 256 else b""
            if len(self._counts) < 4096:
                self._counts[n] = counts
        req = LookupRequest(
            tenant_id=tenant, model_id=model, hash_scheme=self.hash_scheme, adapter_id=adapter,
            block_hashes=chain, packed_hashes=True,
            block_token_counts=counts if counts else [self.block_size] * n,
        )
        t0 = time.perf_counter()
        if self.replica is None:
            return Hint(reasons.HINT_ERROR, latency_s=0.0)
        try:
            resp = self.replica.lookup(req)
        except Exception as e:  # never fail a request because of the hint plane
            elapsed = time.perf_counter() - t0
            self._log_error(f"{type(e).__name__}: {e}")
            return Hint(reasons.HINT_ERROR, latency_s=elapsed)
        return hint_of(resp, time.perf_counter() - t0)
