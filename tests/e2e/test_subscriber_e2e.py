"""Fake engine process → subscriber process → the real ``inferencecache serve`` process, checked
through ``LookupRoute`` (engine-events-and-subscriber.md §3.1, §3.2, §3.7, §5; the issue's
end-to-end list).

Every process is started with ports chosen at run time and stopped by its own PID in the
fixture's teardown, even when a test fails. Prompts are several blocks long (above the server's
64-token floor) and each is held by one of two replicas, so a hit is a ``PREFIX_MATCH``.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from inferencecache.procs import Child, Children
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "e2e-model"
BLOCK = 16


def prompt(seed: int, blocks: int = 6) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 120_000) for _ in range(blocks * BLOCK)]


class Fleet:
    """The processes of one test; ``close()`` stops each by PID."""

    def __init__(self) -> None:
        self.children = Children()
        self.grpc_address = ""
        self.server_proc: Child | None = None
        self.channel: grpc.Channel | None = None
        self.stub: Any = None

    def _start(self, *args: str, stdin: bool = False) -> Child:
        return self.children.start(*args, stdin=stdin)

    # ---- processes ------------------------------------------------------------------------------

    def server(self, grpc_address: str = "127.0.0.1:0") -> Child:
        p = self._start("serve", "--grpc-address", grpc_address, "--http-address",
                        "127.0.0.1:0", "--block-size", str(BLOCK))
        rec = p.wait_log("serving", timeout=20)
        self.grpc_address = rec["grpc_address"]
        self.server_proc = p
        if self.channel is None:
            self.channel = grpc.insecure_channel(self.grpc_address)
            self.stub = pb_grpc.InferenceCacheStub(self.channel)
        return p

    def engine(
        self, bind: str = "tcp://127.0.0.1:0", replay: bool = False
    ) -> tuple[Child, dict[str, Any]]:
        args = ["fake-engine", "--mode", "script", "--script", "-", "--bind", bind,
                "--http-address", "127.0.0.1:0", "--block-size", str(BLOCK)]
        if replay:
            args += ["--replay-endpoint", "tcp://127.0.0.1:0"]
        p = self._start(*args, stdin=True)
        return p, p.wait_log("fake engine ready", timeout=20)

    def subscriber(self, replica: str, ready: dict[str, Any], *extra: str) -> tuple[Child, str]:
        p = self._start(
            "subscribe", "--replica-id", replica, "--model-id", MODEL,
            "--engine-endpoint", ready["endpoint"], "--server", self.grpc_address,
            "--metrics-address", "127.0.0.1:0", "--window", "20ms", "--block-size", str(BLOCK),
            "--engine-metrics-url", f"http://{ready['http_address']}/metrics",
            "--stats-interval", "1s", *extra,
        )
        rec = p.wait_log("metrics listening", timeout=20)
        return p, f"http://{rec['address']}/metrics"

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.children.stop_all()

    # ---- helpers -------------------------------------------------------------------------------

    @staticmethod
    def metric(url: str, name: str) -> float:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("inferencecache_subscriber_" + name):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def sync(self, engine: Child, metrics_url: str, timeout: float = 15.0) -> None:
        """Publish harmless clears until the subscriber has received one (slow joiner)."""
        start = self.metric(metrics_url, "batches_received_total")
        deadline = time.monotonic() + timeout
        while self.metric(metrics_url, "batches_received_total") <= start:
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            engine.send(json.dumps({"op": "clear"}))
            time.sleep(0.1)
        time.sleep(0.2)  # let the probes' ALL_CLEARED reach the server first

    def lookup(self, tokens: list[int], adapter: str = "") -> Any:
        req = pb.LookupRouteRequest(model_id=MODEL, tenant_id="default", hash_scheme="vllm",
                                    token_ids=tokens, adapter_id=adapter)
        return self.stub.LookupRoute(req, timeout=2.0)

    def wait_match(self, tokens: list[int], replica: str | None, adapter: str = "",
                   timeout: float = 5.0, matched: int | None = None) -> Any:
        """Poll until the lookup is PREFIX_MATCH led by ``replica`` (``None``: until it is not
        a PREFIX_MATCH naming any replica)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = self.lookup(tokens, adapter)
            except grpc.RpcError:
                time.sleep(0.05)
                continue
            hit = last.reason_code == "PREFIX_MATCH" and last.replica_scores
            if replica is None and not hit:
                return last
            top = last.replica_scores[0] if hit else None
            if (replica is not None and top is not None and top.replica_id == replica
                    and (matched is None or top.matched_tokens == matched)):
                return last
            time.sleep(0.05)
        raise AssertionError(f"lookup did not reach the expected state in {timeout}s: {last}")


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


def two_replicas(fleet: Fleet, replay: bool = False,
                 sub_args: tuple[str, ...] = ()) -> dict[str, Any]:
    fleet.server()
    ea, ra = fleet.engine(replay=replay)
    eb, rb = fleet.engine()
    extra = ["--replay-endpoint", ra["replay_endpoint"]] if replay else []
    sa, ma = fleet.subscriber("replica-a", ra, *extra, *sub_args)
    sb, mb = fleet.subscriber("replica-b", rb, *sub_args)
    fleet.sync(ea, ma)
    fleet.sync(eb, mb)
    return {"ea": ea, "eb": eb, "ra": ra, "rb": rb, "sa": sa, "sb": sb, "ma": ma, "mb": mb}


def store(engine: Child, tokens: list[int], **kw: Any) -> None:
    engine.send(json.dumps({"op": "store", "tokens": tokens, **kw}))


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "per-block"])
def test_e2e_prefix_match_on_the_right_replica_then_eviction_removes_it(
    fleet: Fleet, batch: bool
) -> None:
    """One BlockRemoved of the prompt's 6 blocks: one batched PublishEvent (field 8) or one per
    block (``--batch-evictions=false``); the server drops all 6 either way."""
    f = two_replicas(fleet, sub_args=() if batch else ("--batch-evictions=false",))
    pa, pb_ = prompt(1), prompt(2)
    store(f["ea"], pa)
    store(f["eb"], pb_)
    r = fleet.wait_match(pa, "replica-a", matched=96)
    assert [s.replica_id for s in r.replica_scores] == ["replica-a"]
    fleet.wait_match(pb_, "replica-b", matched=96)
    longer = fleet.wait_match(pa + prompt(3, 2), "replica-a")
    assert longer.replica_scores[0].matched_tokens == 96
    f["ea"].send(json.dumps({"op": "remove", "tokens": pa}))
    after = fleet.wait_match(pa, None)
    assert all(s.replica_id != "replica-a" or after.reason_code != "PREFIX_MATCH"
               for s in after.replica_scores)
    fleet.wait_match(pb_, "replica-b", matched=96)  # the other replica is untouched
    assert fleet.metric(f["ma"], "evictions_total") == 6
    for i in range(1, 7):  # no block of the prompt is left on replica-a (batched: all 6 hashes)
        r = fleet.lookup(pa[: 16 * i])
        assert not any(s.replica_id == "replica-a" for s in r.replica_scores)


def test_e2e_two_adapters_over_identical_tokens_never_alias(fleet: Fleet) -> None:
    f = two_replicas(fleet)
    pc = prompt(4)
    store(f["ea"], pc, lora_id=1, lora_name="sql-lora")
    store(f["eb"], pc, lora_id=1, lora_name="chat-lora")  # same engine id, another adapter
    r = fleet.wait_match(pc, "replica-a", adapter="sql-lora", matched=96)
    assert [s.replica_id for s in r.replica_scores] == ["replica-a"]
    r = fleet.wait_match(pc, "replica-b", adapter="chat-lora", matched=96)
    assert [s.replica_id for s in r.replica_scores] == ["replica-b"]
    base = fleet.lookup(pc, "")
    assert base.reason_code != "PREFIX_MATCH"


def test_e2e_server_restart_resyncs_quiet_and_under_traffic(fleet: Fleet) -> None:
    f = two_replicas(fleet)
    pa, pb_ = prompt(5), prompt(6)
    store(f["ea"], pa)
    store(f["eb"], pb_)
    fleet.wait_match(pa, "replica-a", matched=96)
    fleet.wait_match(pb_, "replica-b", matched=96)
    address = fleet.grpc_address
    # 1. Kill the server and bring it back on the same address while the engines are quiet.
    assert fleet.server_proc is not None
    fleet.server_proc.kill()
    time.sleep(0.5)
    fleet.server(address)
    fleet.wait_match(pa, "replica-a", matched=96, timeout=5.0)
    fleet.wait_match(pb_, "replica-b", matched=96, timeout=5.0)
    # 2. Again, with engine traffic during the outage and after it.
    assert fleet.server_proc is not None
    fleet.server_proc.kill()
    during = [prompt(100 + i) for i in range(5)]
    for p in during:
        store(f["eb"], p)
        time.sleep(0.1)
    fleet.server(address)
    after = prompt(200)
    store(f["ea"], after)
    fleet.wait_match(pa, "replica-a", matched=96, timeout=5.0)
    fleet.wait_match(pb_, "replica-b", matched=96, timeout=5.0)
    for p in during:
        fleet.wait_match(p, "replica-b", matched=96, timeout=5.0)
    fleet.wait_match(after, "replica-a", matched=96, timeout=5.0)
    assert Fleet.metric(f["ma"], "resyncs_total") >= 2


def test_e2e_engine_restart_clears_its_stale_blocks_at_once(fleet: Fleet) -> None:
    f = two_replicas(fleet)
    pa, pb_ = prompt(7), prompt(8)
    store(f["ea"], pa)
    store(f["eb"], pb_)
    fleet.wait_match(pa, "replica-a", matched=96)
    endpoint = f["ra"]["endpoint"]
    assert f["ea"].stop() == 0  # the engine process goes away
    fleet.wait_match(pa, None, timeout=3.0)
    assert Fleet.metric(f["ma"], "engine_restarts_total") >= 1
    fleet.wait_match(pb_, "replica-b", matched=96)
    # A new engine process on the same address starts again from seq 0.
    ea2, _ = fleet.engine(bind=endpoint)
    fleet.sync(ea2, f["ma"])
    fresh = prompt(9)
    store(ea2, fresh)
    fleet.wait_match(fresh, "replica-a", matched=96)
    assert fleet.lookup(pa).reason_code != "PREFIX_MATCH" or all(
        s.replica_id != "replica-a" for s in fleet.lookup(pa).replica_scores)


def test_e2e_gap_with_replay_loses_nothing(fleet: Fleet) -> None:
    f = two_replicas(fleet, replay=True)
    hidden, visible = prompt(10), prompt(11)
    f["ea"].send(json.dumps({"ops": [{"op": "store", "tokens": hidden}], "live": False}))
    store(f["ea"], visible)
    fleet.wait_match(visible, "replica-a", matched=96)
    fleet.wait_match(hidden, "replica-a", matched=96)
    assert Fleet.metric(f["ma"], "replayed_batches_total") >= 1
    assert Fleet.metric(f["ma"], "missed_batches_total") == 0
