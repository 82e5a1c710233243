"""The gRPC client of the subscriber: one lazily connecting channel, bounded calls.

Every call has its own 5 s deadline and a fresh ``ReportCacheState`` stream per update (spec
§3.5). The channel's reconnect backoff is kept at ≤ 1 s so a restarted server is seen within a
second (§3.7). ``report`` takes an update already encoded as wire bytes (``UpdateEncoder``) or a
protobuf message; the wire is standard v1alpha1 either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import grpc
import grpc.aio

from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

RPC_DEADLINE: Final = 5.0
REPORT_PATH: Final = "/inferencecache.v1alpha1.InferenceCache/ReportCacheState"

CHANNEL_OPTIONS: Final[list[tuple[str, Any]]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Never drop to IDLE on our own: an idle channel would look like a lost connection.
    ("grpc.client_idle_timeout_ms", 2**31 - 1),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


class CacheClient:
    """Thin async wrapper over the ``InferenceCache`` stub."""

    def __init__(self, target: str, deadline: float = RPC_DEADLINE) -> None:
        self.target = target
        self.deadline = deadline
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.InferenceCacheStub(self.channel)  # type: ignore[no-untyped-call]
        self._report = self.channel.stream_unary(
            REPORT_PATH, request_serializer=_wire_bytes, response_deserializer=pb.Ack.FromString)

    async def report(self, update: pb.CacheStateUpdate | bytes) -> pb.Ack:
        """Send one update on a fresh client stream, half-close, await the Ack."""
        ack: pb.Ack = await self._report(iter((update,)), timeout=self.deadline)
        return ack

    async def report_many(self, updates: Sequence[pb.CacheStateUpdate | bytes]) -> pb.Ack:
        """Several updates, in order, on one fresh client stream (the server applies each on
        receipt), half-close, await the Ack."""
        ack: pb.Ack = await self._report(iter(updates), timeout=self.deadline)
        return ack

    async def publish(self, event: pb.CacheEvent) -> pb.Ack:
        """Unary ``PublishEvent``."""
        ack: pb.Ack = await self._stub.PublishEvent(event, timeout=self.deadline)
        return ack

    async def close(self) -> None:
        await self.channel.close(grace=None)


def _wire_bytes(update: pb.CacheStateUpdate | bytes) -> bytes:
    """Request serializer: pre-encoded bytes pass as they are."""
    return update if isinstance(update, bytes) else bytes(update.SerializeToString())


def describe_error(e: BaseException) -> str:
    """One-line rendering of an RPC error (status code and details) for logs."""
    details = getattr(e, "details", None)
    code = getattr(e, "code", None)
    if callable(details) and callable(code):
        try:
            return f"{code()}: {details()}"
        except Exception:  # pragma: no cover - defensive
            pass
    return f"{type(e).__name__}: {e}"
