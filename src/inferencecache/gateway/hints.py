"""The LookupRoute clients: a short deadline, and never an exception.

Two transports, the same request and answer: ``HttpHintClient`` POSTs the ``LookupRouteRequest``
bytes to the server's HTTP lookup listener (``serve --lookup-http-address``) over a keep-alive
connection pool, ``HintClient`` calls the gRPC method on one ``grpc.aio`` channel. The HTTP path
is the cheaper one on both sides (docs/gateway.md has the figures), so the gateway uses it
whenever ``--lookup-url`` is set. Every outcome becomes a ``routing.Hint``: the server's reason
code and ranked replicas, or a gateway-side code (``HINT_TIMEOUT`` when our deadline passed,
``HINT_ERROR`` for any other failure), so the policy falls back and the request goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final, Protocol

import aiohttp
import grpc
import grpc.aio

from inferencecache import fingerprint
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


def hint_of(resp: pb.LookupRouteResponse, elapsed: float) -> Hint:
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


class HttpHintClient:
    """Asks LookupRoute over the server's HTTP lookup listener (``POST /v1/lookup``, protobuf
    bodies) on a keep-alive connection pool."""

    def __init__(self, url: str, timeout: float, hash_scheme: str, block_size: int) -> None:
        self.target = url.rstrip("/") + "/v1/lookup"
        self.timeout = timeout
        self.hash_scheme = hash_scheme
        self.block_size = block_size
        self._session: aiohttp.ClientSession | None = None
        self._log_error = _ErrorLog(self.target)
        self._headers = {"Content-Type": "application/x-protobuf"}

    async def start(self, connect_wait: float = 1.0) -> bool:
        """Open the pool and make one request (an empty one answers NO_HINT) to connect."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )
        try:
            async with asyncio.timeout(connect_wait), self._session.post(
                self.target, data=b"", headers=self._headers
            ) as r:
                await r.read()
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def lookup(self, tenant: str, model: str, adapter: str, chain: bytes) -> Hint:
        """One LookupRoute; ``latency_s`` is the round trip as this process saw it."""
        body = chain_request(
            tenant, model, self.hash_scheme, adapter, chain, self.block_size
        ).SerializeToString()
        t0 = time.perf_counter()
        session = self._session
        try:
            if session is None:
                raise RuntimeError("hint client not started")
            async with asyncio.timeout(self.timeout):
                async with session.post(self.target, data=body, headers=self._headers) as r:
                    raw = await r.read()
                    status = r.status
            if status != 200:
                raise RuntimeError(f"HTTP {status}")
            resp = pb.LookupRouteResponse.FromString(raw)
        except TimeoutError:
            return Hint(reasons.HINT_TIMEOUT, latency_s=time.perf_counter() - t0)
        except Exception as e:  # never fail a request because of the hint plane
            elapsed = time.perf_counter() - t0
            self._log_error(f"{type(e).__name__}: {e}")
            return Hint(reasons.HINT_ERROR, latency_s=elapsed)
        return hint_of(resp, time.perf_counter() - t0)


class HintClient:
    """Asks LookupRoute over gRPC with the gateway's own fingerprint chain."""

    def __init__(self, target: str, timeout: float, hash_scheme: str, block_size: int) -> None:
        self.target = target
        self.timeout = timeout
        self.hash_scheme = hash_scheme
        self.block_size = block_size
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._log_error = _ErrorLog(target)

    async def start(self, connect_wait: float = 1.0) -> bool:
        """Open the channel and wait up to ``connect_wait`` for it to connect or fail.

        Returns True when connected. A refused connection returns at once (the first requests
        then fall back while the channel keeps retrying in the background).
        """
        self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
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

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None

    async def lookup(self, tenant: str, model: str, adapter: str, chain: bytes) -> Hint:
        """One LookupRoute; ``latency_s`` is the round trip as this process saw it."""
        req = chain_request(tenant, model, self.hash_scheme, adapter, chain, self.block_size)
        t0 = time.perf_counter()
        try:
            resp = await self._call(req, timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            elapsed = time.perf_counter() - t0
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return Hint(reasons.HINT_TIMEOUT, latency_s=elapsed)
            self._log_error(f"{e.code().name}: {e.details()}")
            return Hint(reasons.HINT_ERROR, latency_s=elapsed)
        except Exception as e:  # never fail a request because of the hint plane
            elapsed = time.perf_counter() - t0
            self._log_error(f"{type(e).__name__}: {e}")
            return Hint(reasons.HINT_ERROR, latency_s=elapsed)
        return hint_of(resp, time.perf_counter() - t0)
