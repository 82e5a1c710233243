"""A scriptable InferenceCache gRPC server (LookupRoute only) on a loopback port."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc


@dataclass
class FakeHints(pb_grpc.InferenceCacheServicer):
    reason_code: str = "PREFIX_MATCH"
    replicas: Sequence[str] = ()
    matched: int = 0
    delay: float = 0.0
    requests: list[pb.LookupRouteRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def LookupRoute(self, request: pb.LookupRouteRequest, context: Any) -> pb.LookupRouteResponse:
        with self.lock:
            self.requests.append(request)
        if self.delay:
            time.sleep(self.delay)
        return pb.LookupRouteResponse(
            reason_code=self.reason_code,
            replica_scores=[
                pb.ReplicaScore(replica_id=r, score=1.0, matched_tokens=self.matched)
                for r in self.replicas
            ],
        )


@contextmanager
def fake_hint_server(servicer: FakeHints, port: int = 0) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_InferenceCacheServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield f"127.0.0.1:{bound}"
    finally:
        server.stop(0).wait(5)
