"""LookupRouteRequest wire bytes (the server's hot request parser), differential against
protobuf through ``fuzz.adapters``: the server's reading equals protobuf's, ``UNDECODABLE``
exactly when protobuf cannot decode; the compiled parser, when it does not decline, reads
exactly what protobuf reads."""

from __future__ import annotations

from fuzz import adapters
from inferencecache import fingerprint
from inferencecache.v1alpha1 import inferencecache_pb2 as pb


def check(data: bytes) -> None:
    want = adapters.lookup_reference(data)
    got = adapters.lookup_server(data)
    if want is None:
        assert got is None, ("decoded what protobuf rejects", got)
    else:
        assert got is not None, "rejected what protobuf decodes"
        assert adapters.lookup_same(got, want), (got, want)
    part = adapters.lookup_compiled(data)
    if part is not None:
        assert want is not None, ("compiled parser decoded what protobuf rejects", part)
        assert adapters.lookup_same(part, want), (part, want)


def seeds() -> list[bytes]:
    hashes, counts = fingerprint.chain(list(range(64)), 16)
    reqs = [
        pb.LookupRouteRequest(model_id="m", tenant_id="t", hash_scheme="vllm",
                              block_hashes=hashes, block_token_counts=counts),
        pb.LookupRouteRequest(model_id="m", tenant_id="t", hash_scheme="vllm",
                              token_ids=list(range(0, 300_000, 997)), adapter_id="a"),
        pb.LookupRouteRequest(model_id="m", prefix_hash=b"12345678", prefix_token_count=32,
                              prompt_text="hello"),
    ]
    reqs[2].slo.ttft_ms = 100
    return [r.SerializeToString() for r in reqs] + [b"\x0a\x01m\x3a\x08" + b"\x01" * 8]
