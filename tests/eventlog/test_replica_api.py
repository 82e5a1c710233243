"""The public in-process replica (``inferencecache.eventlog.Replica``) and the gateway's hint
client on it: exactly what LookupRoute on a server replica answers, without a gRPC hop."""

from __future__ import annotations

import asyncio
import time

import redis

from inferencecache import fingerprint
from inferencecache.eventlog import EventLogConfig, EventLogMetrics, LogNode, Replica, codec
from inferencecache.gateway.hints import ReplicaHintClient
from inferencecache.index import Index, IndexSettings, LookupRequest, Router
from inferencecache.procs import RedisServer
from inferencecache.v1alpha1 import inferencecache_pb2 as pb


def test_replica_and_gateway_hint_client_answer_like_the_server(
    redis_server: RedisServer,
) -> None:
    tokens = list(range(1, 16 * 8 + 1))
    chain = fingerprint.chain_packed(tokens, 16)
    upd = pb.CacheStateUpdate(
        replica_id="engine-0", model_id="m", tenant_id="t", hash_scheme="vllm",
        prefixes=[pb.PrefixEntry(prefix_hash=chain[i:i + 8], token_count=16 * (i // 8 + 1))
                  for i in range(0, len(chain) - 16, 8)])
    server_index = Index(IndexSettings(default_ttl=600.0))  # published; the gateway adopts it
    node = LogNode(server_index, EventLogConfig(redis_server.url), EventLogMetrics())
    node.start()
    try:
        node.submit(codec.KIND_UPDATE, upd.SerializeToString()).result(10)
        assert node.follower.wait_for(1, 10)
        req = LookupRequest(tenant_id="t", model_id="m", hash_scheme="vllm", block_hashes=chain,
                            packed_hashes=True, block_token_counts=[16] * (len(chain) // 8))
        want = Router(server_index).lookup(req)
        assert want.reason_code == "PREFIX_MATCH"
        with Replica(EventLogConfig(redis_server.url)) as replica:
            assert replica.wait_ready(10)
            assert replica.sequence == 1
            got = replica.lookup(req)
            assert (got.reason_code, [(s.replica_id, s.matched_tokens) for s in
                                      got.replica_scores]) == (
                want.reason_code, [(s.replica_id, s.matched_tokens) for s in
                                   want.replica_scores])
            assert replica.cache_state("t", "m").total_prefixes == len(upd.prefixes)

        r = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 10
        while r.get("{inferencecache}:settings") is None:  # published after its first read
            assert time.monotonic() < deadline
            time.sleep(0.05)

        async def gateway_side() -> tuple[str, tuple[str, ...], tuple[int, ...]]:
            client = ReplicaHintClient(redis_server.url, "inferencecache", "vllm", 16)
            assert await client.start(connect_wait=10.0)
            try:
                hint = await client.lookup("t", "m", "", chain)
                assert client.replica.index.settings.default_ttl == 600.0  # the servers'
            finally:
                await client.close()
            return hint.reason_code, hint.replicas, hint.matched_tokens

        reason, replicas, matched = asyncio.run(gateway_side())
        assert reason == "PREFIX_MATCH" and replicas == ("engine-0",)
        assert matched == (16 * (len(chain) // 8 - 2),)
    finally:
        node.stop()
