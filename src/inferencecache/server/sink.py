"""Where the gRPC service hands accepted ingest: the seam between the server and the index.

``DirectSink`` (the default) applies each update and event to the local index on receipt, as
the server always did. ``LogSink`` (``serve --event-log``) appends the message's exact wire
bytes to the shared event log instead; the index then changes only when the replica's follower
applies the log (``inferencecache.eventlog``), on this replica and every other.

Both give the service its request deserializers (so "decodable" stays protobuf's: an
undecodable request is ``INVALID_ARGUMENT`` either way) and ``accept``: ``None`` when the
message is already applied, or a ``Future`` that completes when it is in the log (an asyncio
server can ``asyncio.wrap_future`` it). ``LogUnavailable`` means the RPC must answer
``UNAVAILABLE`` so the producer keeps and resends its state.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from inferencecache.eventlog import LogNode, LogUnavailable
from inferencecache.eventlog import codec as log_codec
from inferencecache.index.model import PROBE_TENANT, EventLike, PackedUpdate, Update
from inferencecache.server import lookup_wire
from inferencecache.server.report_request import parse_event_request, parse_update_request
from inferencecache.updatewire.index_input import decode_update
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

__all__ = ["DirectSink", "IngestSink", "LogSink", "LogUnavailable", "safe_deserializer"]

UPDATE = "update"
EVENT = "event"


def safe_deserializer(message_cls: Any) -> Callable[[bytes], Any]:
    """``message_cls.FromString`` that returns ``UNDECODABLE`` instead of raising."""
    parse = message_cls.FromString

    def deserialize(buf: bytes) -> Any:
        try:
            return parse(buf)
        except Exception:
            return lookup_wire.UNDECODABLE

    return deserialize


class IngestSink(Protocol):
    def update_deserializer(self) -> Callable[[bytes], Any]: ...
    def event_deserializer(self) -> Callable[[bytes], Any]: ...
    def accept(self, kind: str, msg: Any) -> Future[None] | None: ...


class Applier(Protocol):
    def apply_update(self, update: Update | PackedUpdate) -> None: ...
    def apply_batch(self, batch: bytes) -> None: ...
    def apply_event(self, event: EventLike) -> None: ...


class DirectSink:
    """Apply on receipt (no event log)."""

    def __init__(self, backend: Applier) -> None:
        self._backend = backend

    def update_deserializer(self) -> Callable[[bytes], Any]:
        return parse_update_request

    def event_deserializer(self) -> Callable[[bytes], Any]:
        return parse_event_request

    def accept(self, kind: str, msg: Any) -> Future[None] | None:
        if type(msg) is bytes:  # an ICB1 batch of the request deserializer (index/batch.py)
            self._backend.apply_batch(msg)
        elif kind == UPDATE:
            self._backend.apply_update(msg)
        else:
            self._backend.apply_event(msg)
        return None


class _Raw:
    """A validated message's wire bytes, as the log stores them."""

    __slots__ = ("data", "replica_id", "skip")

    def __init__(self, data: bytes, replica_id: str, skip: bool) -> None:
        self.data = data
        self.replica_id = replica_id
        self.skip = skip  # the reserved probe tenant: dropped by every replica anyway


class LogSink:
    """Append to the event log (``serve --event-log``)."""

    def __init__(self, node: LogNode) -> None:
        self._node = node

    def update_deserializer(self) -> Callable[[bytes], Any]:
        def deserialize(buf: bytes) -> Any:
            update = decode_update(buf)
            if update is None:
                return lookup_wire.UNDECODABLE
            return _Raw(bytes(buf), update.replica_id, update.tenant_id == PROBE_TENANT)

        return deserialize

    def event_deserializer(self) -> Callable[[bytes], Any]:
        def deserialize(buf: bytes) -> Any:
            try:
                event = pb.CacheEvent.FromString(buf)
            except Exception:
                return lookup_wire.UNDECODABLE
            return _Raw(bytes(buf), event.replica_id, event.tenant_id == PROBE_TENANT)

        return deserialize

    def accept(self, kind: str, msg: Any) -> Future[None] | None:
        raw: _Raw = msg
        if raw.skip:
            return None
        return self._node.submit(
            log_codec.KIND_UPDATE if kind == UPDATE else log_codec.KIND_EVENT, raw.data
        )
