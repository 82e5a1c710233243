"""The gRPC client of the subscriber: one lazily connecting channel, bounded calls.

Every call has its own 5 s deadline and a fresh ``ReportCacheState`` stream per update (spec
engine-events-and-subscriber.md §3.5). The channel's reconnect backoff is kept at ≤ 1 s so a
restarted server is seen within a second (engine-events-and-subscriber.md §3.7). ``report`` takes an
update already encoded as wire bytes (``UpdateEncoder``) or a protobuf message; the wire is standard
v1alpha1 either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inferencecache.channels import PLAINTEXT, ChannelSecurity, FollowedChannel
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

RPC_DEADLINE: Final = 5.0
REPORT_PATH: Final = "/inferencecache.v1alpha1.InferenceCache/ReportCacheState"
CACHE_EVENT: Final = "inferencecache.v1alpha1.CacheEvent"
BATCH_FIELD: Final = 8
"""``CacheEvent.prefix_hashes``: the additive field that batches evictions (docs/subscriber.md)."""

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

    def __init__(
        self, target: str, deadline: float = RPC_DEADLINE, security: ChannelSecurity = PLAINTEXT
    ) -> None:
        self.target = target
        self.deadline = deadline
        self.security = security
        self._followed = FollowedChannel(target, security, CHANNEL_OPTIONS, grace=deadline)
        self._generation = -1
        self._batching: bool | None = None
        self._bind()

    @property
    def channel(self) -> grpc.aio.Channel:
        """The current channel (a new one after the TLS files changed: ``FollowedChannel``)."""
        return self._followed.current()

    def _bind(self) -> None:
        """(Re)bind the stubs when the channel was replaced."""
        channel = self._followed.current()
        if self._followed.generation == self._generation:
            return
        self._generation = self._followed.generation
        self._stub = pb_grpc.InferenceCacheStub(channel)  # type: ignore[no-untyped-call]
        self._report = channel.stream_unary(
            REPORT_PATH, request_serializer=_wire_bytes, response_deserializer=pb.Ack.FromString)
        self._batching = None

    async def report(self, update: pb.CacheStateUpdate | bytes) -> pb.Ack:
        """Send one update on a fresh client stream, half-close, await the Ack."""
        self._bind()
        ack: pb.Ack = await self._report(iter((update,)), timeout=self.deadline,
                                         metadata=self.security.metadata())  # fmt: skip
        return ack

    async def report_many(self, updates: Sequence[pb.CacheStateUpdate | bytes]) -> pb.Ack:
        """Several updates, in order, on one fresh client stream (the server applies each on
        receipt), half-close, await the Ack."""
        self._bind()
        ack: pb.Ack = await self._report(iter(updates), timeout=self.deadline,
                                         metadata=self.security.metadata())  # fmt: skip
        return ack

    async def publish(self, event: pb.CacheEvent) -> pb.Ack:
        """Unary ``PublishEvent``."""
        self._bind()
        ack: pb.Ack = await self._stub.PublishEvent(event, timeout=self.deadline,
                                                    metadata=self.security.metadata())  # fmt: skip
        return ack

    async def supports_batched_evictions(self) -> bool:
        """Whether the server's contract has ``CacheEvent.prefix_hashes`` (field 8), asked once
        per connection through server reflection. A server without the field would apply only
        the first hash of a batch, so anything but a clear yes (no reflection, an older
        contract, an error) means one hash per ``PublishEvent``."""
        if self._batching is None:
            self._batching = await self._probe_batching()
        return self._batching is True

    def forget_capabilities(self) -> None:
        """The connection came back, maybe to another server build: ask again next time."""
        self._batching = None

    async def _probe_batching(self) -> bool | None:
        """True/False from the server's descriptor; None (ask again) when it did not answer."""
        stub = reflection_pb2_grpc.ServerReflectionStub(self.channel)  # type: ignore[no-untyped-call]
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=CACHE_EVENT)
        try:
            async for resp in stub.ServerReflectionInfo(iter((request,)), timeout=self.deadline):
                return _has_batch_field(resp)
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return None  # not reachable now: the PublishEvent fails anyway; ask again later
            return False  # UNIMPLEMENTED (no reflection) and the like: the safe single form
        return False

    async def close(self) -> None:
        await self._followed.close()


def _has_batch_field(resp: Any) -> bool:
    """Whether a reflection answer describes ``CacheEvent`` with field 8 as repeated bytes."""
    package, _, name = CACHE_EVENT.rpartition(".")
    for raw in resp.file_descriptor_response.file_descriptor_proto:
        fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
        if fd.package != package:
            continue
        for msg in fd.message_type:
            if msg.name == name:
                return any(
                    f.number == BATCH_FIELD
                    and f.type == descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                    and f.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
                    for f in msg.field
                )
    return False


def _wire_bytes(update: pb.CacheStateUpdate | bytes) -> bytes:
    """Request serializer: pre-encoded bytes pass as they are."""
    return update if isinstance(update, bytes) else bytes(update.SerializeToString())


_REFUSED: Final = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def describe_error(e: BaseException) -> str:
    """One-line rendering of an RPC error (status code and details) for logs."""
    details = getattr(e, "details", None)
    code = getattr(e, "code", None)
    if callable(details) and callable(code):
        try:
            status = code()
            if status in _REFUSED:
                return (f"{status}: {details()} (the server refused this sidecar's credential: "
                        "check --auth-token-file / the TLS flags and the credential's role and "
                        "tenants; retrying later)")  # fmt: skip
            return f"{status}: {details()}"
        except Exception:  # pragma: no cover - defensive
            pass
    return f"{type(e).__name__}: {e}"
