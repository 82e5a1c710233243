"""Issue 11 item 1 on real processes: a live engine's resident blocks never expire from the index;
the holds of a subscriber that died or of an engine that went silent still do.

``serve`` runs with a 5 s TTL (swept every 250 ms), each fake engine (``--mode script``, with
its vLLM-named ``/metrics``) stores one prompt and then stays idle, and each subscriber scrapes
the engine's metrics every second (its liveness probe: silent for 3 s = dead) and refreshes
with a 1 s cycle, so a resident block is re-reported at most ~2 s after its previous report,
which leaves the TTL 3 s of slack for a busy machine. Every process is stopped
by its own PID in the fixture's teardown, a frozen engine is thawed first.
"""

from __future__ import annotations

import json
import random
import signal
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
TTL_S = 5.0
REFRESH = "1s"


def prompt(seed: int, blocks: int = 6) -> list[int]:
    rng = random.Random(f"refresh-e2e:{seed}")
    return [rng.randrange(1, 120_000) for _ in range(blocks * BLOCK)]


class Fleet:
    def __init__(self) -> None:
        self.children = Children()
        self.frozen: list[Child] = []
        self.channel: grpc.Channel | None = None
        self.stub: Any = None
        self.grpc_address = ""

    def server(self) -> None:
        p = self.children.start(
            "serve", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--block-size", str(BLOCK), "--default-ttl", f"{TTL_S:g}s",
            "--sweep-interval", "250ms")
        self.grpc_address = p.wait_log("serving", timeout=20)["grpc_address"]
        self.channel = grpc.insecure_channel(self.grpc_address)
        self.stub = pb_grpc.InferenceCacheStub(self.channel)  # type: ignore[no-untyped-call]

    def replica(self, name: str, *sub_args: str) -> tuple[Child, Child, str]:
        """A fake engine and its subscriber, synced (the SUB socket is connected)."""
        engine = self.children.start(
            "fake-engine", "--mode", "script", "--script", "-", "--bind", "tcp://127.0.0.1:0",
            "--http-address", "127.0.0.1:0", "--block-size", str(BLOCK),
            "--model-name", MODEL, stdin=True)
        ready = engine.wait_log("fake engine ready", timeout=20)
        sub = self.children.start(
            "subscribe", "--replica-id", name, "--model-id", MODEL,
            "--engine-endpoint", ready["endpoint"], "--server", self.grpc_address,
            "--metrics-address", "127.0.0.1:0", "--window", "20ms", "--block-size", str(BLOCK),
            "--engine-metrics-url", f"http://{ready['http_address']}/metrics",
            "--stats-interval", "1s", "--engine-models-url", "", *sub_args)
        metrics = f"http://{sub.wait_log('metrics listening', timeout=20)['address']}/metrics"
        deadline = time.monotonic() + 15
        while self.metric(metrics, "batches_received_total") < 1:
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            engine.send(json.dumps({"op": "clear"}))
            time.sleep(0.1)
        time.sleep(0.2)  # the probes' ALL_CLEARED reach the server before the real stores
        return engine, sub, metrics

    @staticmethod
    def metric(url: str, name: str) -> float:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("inferencecache_subscriber_" + name))

    def holder(self, tokens: list[int]) -> str | None:
        """The replica a lookup names first on a PREFIX_MATCH of the whole prompt, else None."""
        r = self.stub.LookupRoute(pb.LookupRouteRequest(
            model_id=MODEL, tenant_id="default", hash_scheme="vllm", token_ids=tokens),
            timeout=2.0)
        if r.reason_code != "PREFIX_MATCH" or not r.replica_scores:
            return None
        top = r.replica_scores[0]
        return str(top.replica_id) if top.matched_tokens == len(tokens) else None

    def wait_holder(self, tokens: list[int], want: str | None, timeout: float) -> float:
        """Poll until ``holder(tokens) == want``; returns the seconds it took."""
        t0 = time.monotonic()
        got = self.holder(tokens)
        while got != want:
            assert time.monotonic() - t0 < timeout, f"holder {got!r}, want {want!r}"
            time.sleep(0.05)
            got = self.holder(tokens)
        return time.monotonic() - t0

    def close(self) -> None:
        for engine in self.frozen:
            engine.signal(signal.SIGCONT)
        if self.channel is not None:
            self.channel.close()
        self.children.stop_all()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        f.server()
        yield f
    finally:
        f.close()


def store(engine: Child, tokens: list[int]) -> None:
    engine.send(json.dumps({"op": "store", "tokens": tokens}))


def test_live_engines_blocks_never_expire_while_unrefreshed_ones_do(fleet: Fleet) -> None:
    """Both engines stay idle after one prompt. The refreshing replica keeps its hint for 2.5
    TTLs; the same setup with ``--refresh-interval 0`` (the control) loses it after one TTL."""
    live_engine, _, live_metrics = fleet.replica("live", "--refresh-interval", REFRESH)
    ctl_engine, _, _ = fleet.replica("control", "--refresh-interval", "0")
    p_live, p_ctl = prompt(1), prompt(2)
    store(live_engine, p_live)
    store(ctl_engine, p_ctl)
    fleet.wait_holder(p_live, "live", timeout=10)
    fleet.wait_holder(p_ctl, "control", timeout=10)
    stored_at = time.monotonic()
    ctl_gone_after: float | None = None
    while time.monotonic() - stored_at < 2.5 * TTL_S:
        assert fleet.holder(p_live) == "live", (
            f"the live engine's hint expired after {time.monotonic() - stored_at:.1f}s")
        if ctl_gone_after is None and fleet.holder(p_ctl) is None:
            ctl_gone_after = time.monotonic() - stored_at
        time.sleep(0.1)
    assert ctl_gone_after is not None, "the control never expired: the TTL is not in effect"
    assert ctl_gone_after >= TTL_S - 1.0  # it was the TTL, not something else
    assert fleet.metric(live_metrics, "refresh_entries_total") >= 6 * 5  # 6 blocks, 1 s cycles
    assert fleet.metric(live_metrics, "engine_alive") == 1


def test_a_dead_subscribers_holds_expire_by_the_ttl(fleet: Fleet) -> None:
    engine, sub, _ = fleet.replica("crashed", "--refresh-interval", REFRESH)
    p = prompt(3)
    store(engine, p)
    fleet.wait_holder(p, "crashed", timeout=10)
    time.sleep(TTL_S)  # refreshed at least once past the first TTL
    assert fleet.holder(p) == "crashed"
    sub.kill()  # SIGKILL: no shutdown, no ALL_CLEARED, no more refreshes
    took = fleet.wait_holder(p, None, timeout=3 * TTL_S)
    assert took <= TTL_S + 2.0, took  # its last refresh ages out: one TTL, not a second one


def test_a_frozen_engines_holds_expire_and_come_back_when_it_thaws(fleet: Fleet) -> None:
    """SIGSTOP keeps the engine's sockets open (no disconnect, no clear): only its silence on the
    metrics probe tells the subscriber, which stops refreshing; the holds then age out. Thawed,
    the engine still holds the blocks and the refresher reports them again."""
    engine, sub, metrics = fleet.replica("frozen", "--refresh-interval", REFRESH)
    p = prompt(4)
    store(engine, p)
    fleet.wait_holder(p, "frozen", timeout=10)
    time.sleep(TTL_S)
    assert fleet.holder(p) == "frozen"
    engine.signal(signal.SIGSTOP)
    fleet.frozen.append(engine)
    fleet.wait_holder(p, None, timeout=4 * TTL_S)
    sub.wait_log("engine not alive", timeout=5)
    assert fleet.metric(metrics, "engine_alive") == 0
    assert fleet.metric(metrics, "engine_restarts_total") == 0  # the socket never dropped
    assert fleet.metric(metrics, "tracked_blocks") == 6  # the subscriber still knows them
    engine.signal(signal.SIGCONT)
    fleet.frozen.remove(engine)
    fleet.wait_holder(p, "frozen", timeout=4 * TTL_S)
    assert fleet.metric(metrics, "engine_alive") == 1
