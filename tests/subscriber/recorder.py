"""A real gRPC server on 127.0.0.1 that records what a subscriber sends (tests only)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection

from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

SERVICE = "inferencecache.v1alpha1.InferenceCache"


def contract_without_batches() -> descriptor_pool.DescriptorPool:
    """The v1alpha1 contract as a server built before ``CacheEvent.prefix_hashes`` (field 8)
    describes it through reflection."""
    pool = descriptor_pool.DescriptorPool()
    fd = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fd)
    for dep in pb.DESCRIPTOR.dependencies:
        dep_fd = descriptor_pb2.FileDescriptorProto()
        dep.CopyToProto(dep_fd)
        pool.Add(dep_fd)
    event = next(m for m in fd.message_type if m.name == "CacheEvent")
    keep = [f for f in event.field if f.number != 8]
    del event.field[:]
    event.field.extend(keep)
    pool.Add(fd)
    return pool


class RecordingServicer(pb_grpc.InferenceCacheServicer):  # type: ignore[misc]
    """Records every update/event in arrival order; can fail, hang or refuse on demand.

    ``log`` is what a server applies, per block: a batched ``PREFIX_EVICTED`` (``prefix_hashes``)
    is logged as one single-hash event per hash, in order (contract: applied in order after
    ``prefix_hash``), so assertions read the same in both ``--batch-evictions`` modes.
    ``rpcs`` is the raw log (one item per message received).
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, Any, float]] = []  # ("update" | "event", message, time)
        self.rpcs: list[tuple[str, Any]] = []
        self.streams = 0
        self.fail = False  # abort every RPC with UNAVAILABLE
        self.hang = 0.0  # sleep this long before answering
        self.accepted = True
        self.attempts = 0
        self.changed = asyncio.Event()

    async def ReportCacheState(self, request_iterator: Any, context: Any) -> pb.Ack:
        self.attempts += 1
        if self.hang:
            await asyncio.sleep(self.hang)
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "test server failing")
        self.streams += 1
        async for update in request_iterator:
            self.log.append(("update", update, time.monotonic()))
            self.rpcs.append(("update", update))
        self.changed.set()
        return pb.Ack(accepted=self.accepted)

    async def PublishEvent(self, request: pb.CacheEvent, context: Any) -> pb.Ack:
        self.attempts += 1
        if self.hang:
            await asyncio.sleep(self.hang)
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "test server failing")
        self.rpcs.append(("event", request))
        now = time.monotonic()
        if request.type == pb.CacheEvent.PREFIX_EVICTED and request.prefix_hashes:
            for h in [request.prefix_hash, *request.prefix_hashes]:
                one = pb.CacheEvent()
                one.CopyFrom(request)
                one.prefix_hash = h
                del one.prefix_hashes[:]
                self.log.append(("event", one, now))
        else:
            self.log.append(("event", request, now))
        self.changed.set()
        return pb.Ack(accepted=True)

    # ---- views --------------------------------------------------------------------------------

    def updates(self) -> list[pb.CacheStateUpdate]:
        return [m for k, m, _ in self.log if k == "update"]

    def events(self) -> list[pb.CacheEvent]:
        return [m for k, m, _ in self.log if k == "event"]

    def publish_calls(self) -> list[pb.CacheEvent]:
        """The PublishEvent messages as received (a batched eviction is one)."""
        return [m for k, m in self.rpcs if k == "event"]

    def prefixes(self) -> list[tuple[str, int, str, int]]:
        return [(p.prefix_hash.hex(), p.token_count, p.adapter_id, p.tier)
                for u in self.updates() for p in u.prefixes]

    def kinds(self) -> list[str]:
        out = []
        for k, m, _ in self.log:
            if k == "update":
                out.append("stats" if m.HasField("stats") and not m.prefixes else "update")
            else:
                out.append(pb.CacheEvent.Type.Name(m.type))
        return out

    async def wait_for(self, predicate: Any, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(f"condition not met within {timeout}s; log={self.kinds()}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.05))


class RecordingServer:
    """``async with RecordingServer() as srv`` → ``srv.address``, ``srv.servicer``."""

    def __init__(
        self, port: int = 0, servicer: RecordingServicer | None = None, contract: str = "current"
    ) -> None:
        """``contract``: what server reflection tells a client: ``current`` (this build's
        contract), ``old`` (before ``CacheEvent.prefix_hashes``) or ``none`` (no reflection)."""
        self.servicer = servicer if servicer is not None else RecordingServicer()
        self.port = port
        self.contract = contract
        self.server: grpc.aio.Server | None = None

    async def start(self) -> RecordingServer:
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_InferenceCacheServicer_to_server(self.servicer, self.server)
        if self.contract != "none":
            pool = contract_without_batches() if self.contract == "old" else None
            reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), self.server,
                                                pool=pool)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> RecordingServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
