"""CacheStateUpdate wire bytes (the server's ReportCacheState parser), differential against
protobuf through ``fuzz.adapters``: the server's reading equals protobuf's (``UNDECODABLE``
exactly when protobuf cannot decode), and whatever the compiled compact parser accepts reads
exactly as protobuf reads it."""

from __future__ import annotations

from fuzz import adapters
from inferencecache import fingerprint
from inferencecache.v1alpha1 import inferencecache_pb2 as pb


def check(data: bytes) -> None:
    want = adapters.update_reference(data)
    got = adapters.update_server(data)
    if want is None:
        assert got is None, ("decoded what protobuf rejects", got)
    else:
        assert got == want, (got, want)
    compiled = adapters.update_compiled(data)
    if compiled is not None:
        assert want is not None, ("compact parser decoded what protobuf rejects", compiled)
        assert compiled == want, (compiled, want)


def seeds() -> list[bytes]:
    hashes, counts = fingerprint.chain(list(range(64)), 16)
    legacy = [pb.PrefixEntry(prefix_hash=h, token_count=c, tier=pb.CACHE_TIER_T1)
              for h, c in zip(hashes, counts, strict=True)]
    chain = pb.PrefixEntry(block_hashes=hashes, block_token_counts=counts, adapter_id="a")
    msgs = [
        pb.CacheStateUpdate(replica_id="r", model_id="m", tenant_id="t", hash_scheme="vllm",
                            timestamp_us=5, prefixes=legacy),
        pb.CacheStateUpdate(replica_id="r", model_id="m", prefixes=[chain, *legacy[:2]],
                            adapter_id="x"),
        pb.CacheStateUpdate(replica_id="r", stats=pb.ReplicaStats(replica_id="r", hit_rate=0.5)),
    ]
    return [m.SerializeToString() for m in msgs]
