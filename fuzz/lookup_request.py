"""LookupRouteRequest wire bytes (the server's hot request parser), differential against
protobuf through ``fuzz.adapters``: the server's reading equals protobuf's, ``UNDECODABLE``
exactly when protobuf cannot decode; the compiled parser and the Python fast parser, when they
do not decline, read exactly what protobuf reads."""

from __future__ import annotations

import os

from fuzz import adapters
from inferencecache import fingerprint
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

# Campaigns only (INFERENCECACHE_FUZZ_KNOWN=1): skip the divergences already reported, so a
# long run goes on looking for new ones; CI never sets it.
KNOWN = os.environ.get("INFERENCECACHE_FUZZ_KNOWN") == "1"


def check(data: bytes) -> None:
    want = adapters.lookup_reference(data)
    got = adapters.lookup_server(data)
    if want is None:
        if got is not None and KNOWN:
            known = adapters.lookup_known_divergence(data)
            if known is not None and adapters.lookup_same(got, known):
                return
        assert got is None, ("decoded what protobuf rejects", got)
    else:
        assert got is not None, "rejected what protobuf decodes"
        assert adapters.lookup_same(got, want), (got, want)
    for name, parse in (("compiled", adapters.lookup_compiled), ("fast", adapters.lookup_fast)):
        part = parse(data)
        if part is not None:
            assert want is not None, (name, "decoded what protobuf rejects", part)
            assert adapters.lookup_same(part, want), (name, part, want)


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
