"""Scale-out on the shared event log, every part a real process (docs/event-log.md, the issue's
end-to-end list): fake engine → subscriber → replica A; replica B answers the same; B killed
(SIGKILL) and started again → caught up from its snapshot + the log, ready; Redis stopped under
live traffic and started again → converged, nothing lost; two replicas identical on thousands
of random LookupRoute and GetCacheState requests.

A private redis-server per test (127.0.0.1, free port, temp dir); every process stopped by its
PID in teardown.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from inferencecache.procs import Children, RedisServer
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "e2e-model"
BLOCK = 16


def prompt(seed: int, blocks: int = 6) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 120_000) for _ in range(blocks * BLOCK)]


class Replica:
    """One ``serve --event-log`` process and a channel to it."""

    def __init__(self, children: Children, url: str, snap_dir: str, grpc_address: str) -> None:
        self.children = children
        self.proc = children.start(
            "serve", "--grpc-address", grpc_address, "--http-address", "127.0.0.1:0",
            "--block-size", str(BLOCK), "--event-log", url, "--snapshot-dir", snap_dir,
            "--snapshot-interval", "1s")
        rec = self.proc.wait_log("serving", timeout=30)
        self.grpc_address = rec["grpc_address"]
        self.http = f"http://{rec['http_address']}"
        self.channel = grpc.insecure_channel(self.grpc_address)
        self.stub: Any = pb_grpc.InferenceCacheStub(self.channel)  # type: ignore[no-untyped-call]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.http + "/readyz", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.http + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def lookup(self, tokens: list[int]) -> Any:
        return self.stub.LookupRoute(pb.LookupRouteRequest(
            model_id=MODEL, tenant_id="default", hash_scheme="vllm", token_ids=tokens),
            timeout=2.0)

    def close(self) -> None:
        self.channel.close()


def answer(r: Any) -> tuple[str, list[tuple[str, int, int]]]:
    return r.reason_code, [(s.replica_id, s.matched_tokens, s.tier) for s in r.replica_scores]


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def holds_prompt(rep: Replica, tokens: list[int], replica_id: str) -> bool:
    try:
        r = rep.lookup(tokens)
    except grpc.RpcError:
        return False
    return bool(r.reason_code == "PREFIX_MATCH" and r.replica_scores
                and r.replica_scores[0].replica_id == replica_id
                and r.replica_scores[0].matched_tokens == len(tokens))


@pytest.fixture
def redis_dir(tmp_path: Any) -> str:
    d = tmp_path / "redis"
    d.mkdir()
    return str(d)


@pytest.fixture
def children() -> Iterator[Children]:
    with Children() as c:
        yield c


def test_e2e_replicas_restart_from_snapshot_and_survive_redis_outage(
    tmp_path: Any, redis_dir: str, children: Children
) -> None:
    redis_srv = RedisServer(redis_dir).start()
    reps: list[Replica] = []
    try:
        a = Replica(children, redis_srv.url, str(tmp_path / "a"), "127.0.0.1:0")
        b = Replica(children, redis_srv.url, str(tmp_path / "b"), "127.0.0.1:0")
        reps += [a, b]
        engine = children.start("fake-engine", "--mode", "script", "--script", "-", "--bind",
                                "tcp://127.0.0.1:0", "--http-address", "127.0.0.1:0",
                                "--block-size", str(BLOCK), stdin=True)
        ready = engine.wait_log("fake engine ready", timeout=20)
        sub = children.start(
            "subscribe", "--replica-id", "replica-a", "--model-id", MODEL, "--engine-endpoint",
            ready["endpoint"], "--server", a.grpc_address, "--metrics-address", "127.0.0.1:0",
            "--window", "20ms", "--block-size", str(BLOCK))
        sub.wait_log("connected to the engine", timeout=30)
        wait_until(lambda: a.ready() and b.ready(), 30, "both replicas ready")

        def store(seed: int) -> list[int]:
            tokens = prompt(seed)
            engine.send(json.dumps({"op": "store", "tokens": tokens}))
            return tokens

        # the subscriber is a slow joiner: store until the first prompt reaches the log
        first = prompt(1)
        deadline = time.monotonic() + 60
        while not holds_prompt(b, first, "replica-a"):
            assert time.monotonic() < deadline, "ingest never reached replica B"
            store(1)
            time.sleep(0.2)
        stored = [first] + [store(s) for s in range(2, 12)]
        # replica B (no subscriber talks to it) answers what A was told
        for tokens in stored:
            wait_until(lambda t=tokens: holds_prompt(b, t, "replica-a"), 10, "B to match")
        assert answer(a.lookup(stored[3])) == answer(b.lookup(stored[3]))

        # B killed mid-flight; more ingest meanwhile; B again on the same address
        wait_until(lambda: b.metric("inferencecache_eventlog_snapshots_total") >= 1, 15,
                   "a snapshot of B")
        address = b.grpc_address
        b.proc.kill()
        b.close()
        stored += [store(s) for s in range(12, 20)]
        wait_until(lambda: holds_prompt(a, stored[-1], "replica-a"), 10, "A to match")
        b = Replica(children, redis_srv.url, str(tmp_path / "b"), address)
        reps.append(b)
        loaded = b.proc.wait_log("loaded snapshot", timeout=20)
        assert loaded["sequence"] > 0
        wait_until(b.ready, 20, "B ready after the restart")
        for tokens in stored:
            wait_until(lambda t=tokens: holds_prompt(b, t, "replica-a"), 10,
                       "B to match after its restart")

        # Redis stops under live traffic and comes back: nothing accepted is lost
        redis_srv.stop()
        during = [store(s) for s in range(20, 26)]
        time.sleep(1.0)  # the subscriber's appends fail (UNAVAILABLE) and it backs off
        assert holds_prompt(b, stored[0], "replica-a")  # lookups answered from memory
        redis_srv.start()
        after = [store(s) for s in range(26, 30)]
        for tokens in stored + during + after:  # its resync re-sends what failed
            wait_until(lambda t=tokens: holds_prompt(a, t, "replica-a"), 30, "A converged")
            wait_until(lambda t=tokens: holds_prompt(b, t, "replica-a"), 30, "B converged")
        assert a.metric("inferencecache_eventlog_append_errors_total") >= 1
        for tokens in stored + during + after:
            assert answer(a.lookup(tokens)) == answer(b.lookup(tokens))
    finally:
        for r in reps:
            r.close()
        children.stop_all()
        redis_srv.stop()


def test_e2e_two_replicas_answer_identically(
    tmp_path: Any, redis_dir: str, children: Children
) -> None:
    """Both replicas append (a producer per replica), both apply everything, B is killed with
    SIGKILL while entries flow and started again (its snapshot + the log); then thousands of
    random requests get the same reason, replicas in the same order, the same matched tokens
    and tiers, and the same GetCacheState (scores differ only by the time between calls)."""
    redis_srv = RedisServer(redis_dir).start()
    a = b = None
    try:
        a = Replica(children, redis_srv.url, str(tmp_path / "a"), "127.0.0.1:0")
        b = Replica(children, redis_srv.url, str(tmp_path / "b"), "127.0.0.1:0")
        rng = random.Random(20261201)
        keys = [rng.randrange(2**64).to_bytes(8, "big") for _ in range(400)]
        models = ["m0", "m1"]
        b_down = False
        for i in range(400):
            if i == 150:  # mid-flight: entries keep arriving while B dies
                wait_until(lambda r=b: r.metric("inferencecache_eventlog_snapshots_total") >= 1,
                           15, "a snapshot of B")
                b.proc.kill()
                b.close()
                b_down = True
            if i == 300:  # back on the snapshot dir it had
                b = Replica(children, redis_srv.url, str(tmp_path / "b"), "127.0.0.1:0")
                assert b.proc.wait_log("loaded snapshot", timeout=20)["sequence"] > 0
                b_down = False
            target = a if i % 2 or b_down else b
            replica = f"engine-{rng.randrange(8)}"
            model = rng.choice(models)
            if rng.random() < 0.8:
                start = rng.randrange(0, 300)
                upd = pb.CacheStateUpdate(
                    replica_id=replica, model_id=model, tenant_id="t", hash_scheme="s",
                    prefixes=[pb.PrefixEntry(prefix_hash=k, token_count=16 * (j + 1),
                                             tier=rng.choice([0, 1, 2]))  # type: ignore[arg-type]
                              for j, k in enumerate(keys[start:start + rng.randrange(1, 60)])])
                if rng.random() < 0.3:
                    upd.stats.hit_rate = rng.random()
                    upd.stats.cache_memory_bytes = rng.randrange(10**9)
                target.stub.ReportCacheState(iter([upd]), timeout=5)
            else:
                target.stub.PublishEvent(pb.CacheEvent(
                    type=pb.CacheEvent.PREFIX_EVICTED, replica_id=replica, model_id=model,
                    tenant_id="t", prefix_hash=rng.choice(keys),
                    prefix_hashes=[rng.choice(keys) for _ in range(rng.randrange(4))]),
                    timeout=5)
        import redis

        head = int(redis.Redis.from_url(redis_srv.url).get("{inferencecache}:seq") or 0)
        assert head > 0
        for rep in (a, b):
            wait_until(lambda r=rep: r.metric(
                "inferencecache_eventlog_replica_applied_sequence") >= head, 20, "caught up")
        mismatches = []
        hits = 0
        for _ in range(2000):
            model = rng.choice(models)
            start = rng.randrange(0, 300)
            chain = keys[start:start + rng.randrange(1, 40)]
            req = pb.LookupRouteRequest(
                tenant_id="t", model_id=model, hash_scheme="s", block_hashes=chain,
                block_token_counts=[16] * len(chain))
            ra, rb = answer(a.stub.LookupRoute(req)), answer(b.stub.LookupRoute(req))
            hits += ra[0] == "PREFIX_MATCH"
            if ra != rb:
                mismatches.append((req, ra, rb))
        assert not mismatches, mismatches[:3]
        assert hits > 100  # the comparison covered real matches
        for model in models:
            req_cs = pb.GetCacheStateRequest(tenant_id="t", model_id=model)
            ca, cb = a.stub.GetCacheState(req_cs), b.stub.GetCacheState(req_cs)
            assert ca == cb
            assert ca.summary.total_prefixes > 0
    finally:
        for r in (a, b):
            if r is not None:
                r.close()
        children.stop_all()
        redis_srv.stop()


def _http(url: str, body: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


def test_e2e_workers_share_the_port_and_the_policy_goes_through_the_log(
    redis_dir: str, children: Children
) -> None:
    """``serve --workers 2``: both workers are replicas on one gRPC port; /metrics labels them;
    ``POST /policy`` (forwarded to worker 0, appended to the log) changes every worker's
    answers; a killed worker is started again and catches up."""
    redis_srv = RedisServer(redis_dir).start()
    try:
        parent = children.start("serve", "--grpc-address", "127.0.0.1:0", "--http-address",
                                 "127.0.0.1:0", "--event-log", redis_srv.url, "--workers", "2")
        rec = parent.wait_log("serving with workers", timeout=60)
        target = f"127.0.0.1:{rec['grpc_port']}"
        http = f"http://127.0.0.1:{rec['http_port']}"
        wait_until(lambda: _http(http + "/readyz")[0] == 200, 30, "workers ready")
        chain = [(i + 1).to_bytes(8, "big") for i in range(8)]
        upd = pb.CacheStateUpdate(replica_id="engine-0", model_id="m", tenant_id="t",
                                  hash_scheme="s", prefixes=[pb.PrefixEntry(
                                      block_hashes=chain, block_token_counts=[16] * 8)])
        with grpc.insecure_channel(target) as ch:
            pb_grpc.InferenceCacheStub(ch).ReportCacheState(  # type: ignore[no-untyped-call]
                iter([upd]), timeout=5)
        req = pb.LookupRouteRequest(tenant_id="t", model_id="m", hash_scheme="s",
                                    block_hashes=chain, block_token_counts=[16] * 8)

        def reasons(n: int = 12) -> set[str]:
            out = set()
            for _ in range(n):  # fresh connections: the kernel spreads them over the workers
                with grpc.insecure_channel(
                        target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                    stub: Any = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
                    out.add(stub.LookupRoute(req, timeout=5).reason_code)
            return out

        wait_until(lambda: reasons() == {"PREFIX_MATCH"}, 20, "every worker to match")
        status, text = _http(http + "/metrics")
        assert status == 200
        assert text.count("# TYPE inferencecache_eventlog_applied_entries_total ") == 1
        for w in ("0", "1"):
            assert f'inferencecache_eventlog_applied_entries_total{{worker="{w}"}} 1.0' in text
        # a 1e9 score floor (G2) turns every match into no match, on every worker
        body = json.dumps({"version": 7, "policies": [
            {"namespace": "t", "routingFloorScore": 1e9, "affinityRouting": False}]}).encode()
        assert _http(http + "/policy", body)[0] == 204
        wait_until(lambda: reasons() == {"NO_HINT"}, 20, "the policy on every worker")
        # a worker killed: started again, replays, ready, same answers
        pids = [r["pid"] for r in parent.records if r.get("msg") == "worker started"]
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        parent.wait_log(lambda r: r.get("msg") == "worker started" and r["pid"] not in pids,
                        timeout=60)
        wait_until(lambda: _http(http + "/readyz")[0] == 200, 30, "ready again")
        assert reasons(16) == {"NO_HINT"}
    finally:
        children.stop_all()
        redis_srv.stop()
