"""The container image, built and run by a private ``dockerd`` (docs/deploy.md, "The image").

The base image is made with debootstrap (no registry is reachable), the wheels are built on the
host and installed with ``--no-index`` by ``scripts/build-image``, exactly the offline build the
docs describe. The containers run with ``--network host`` and listen on 127.0.0.1 (port 0, the
bound ports read from their logs); the fake engine runs on the host. Every container and image is
removed and the daemon stopped by its PID in the fixture's teardown, even on failure.
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferencecache import __version__
from inferencecache.procs import Children
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.deploy.dockerd import Dockerd, base_tarball, build_image, private_dockerd

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
BASE = "inferencecache-test/base:python3"
IMAGE = "inferencecache-test/inferencecache:test"
HARDENED = ("--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges")
MODEL = "image-model"
BLOCK = 16


@pytest.fixture(scope="module")
def docker() -> Iterator[Dockerd]:
    with private_dockerd() as d:
        d.import_tarball(base_tarball(), BASE)
        build_image(d, REPO, IMAGE, BASE, ["--python", sys.executable])
        yield d


def http_get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def test_image_runs_non_root_with_every_accelerator_and_no_build_tools(docker: Dockerd) -> None:
    config = docker.inspect(IMAGE)["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["inferencecache"]
    out = docker.docker("run", "--rm", *HARDENED, IMAGE, "version").stdout
    assert out.strip() == __version__
    uid = docker.docker("run", "--rm", "--entrypoint", "id", IMAGE, "-u").stdout
    assert uid.strip() == "10001"
    check = (
        "import importlib, inferencecache.accelerators as a; "
        "print(len([importlib.import_module(m) for m in a.MODULES]))"
    )
    out = docker.docker(
        "run", "--rm", *HARDENED, "--entrypoint", "/opt/inferencecache/bin/python", IMAGE,
        "-c", check,
    ).stdout
    assert out.strip() == "6"
    # The runtime stage carries the virtual environment only: no compiler, no pip.
    probe = "command -v gcc cc; ls /opt/inferencecache/bin/pip /src 2>/dev/null; true"
    out = docker.docker("run", "--rm", "--entrypoint", "sh", IMAGE, "-c", probe).stdout
    assert out.strip() == ""
    size, base = docker.image_size(IMAGE), docker.image_size(BASE)
    print(f"image {size / 1e6:.0f} MB = base {base / 1e6:.0f} MB + {(size - base) / 1e6:.0f} MB")
    for sub in ("serve", "subscribe", "gateway", "doctor"):
        res = docker.docker("run", "--rm", *HARDENED, IMAGE, sub, "--help")
        assert "--help" in res.stdout


def wait_serving(stub: pb_grpc.InferenceCacheStub, tokens: list[int], replica: str) -> None:
    deadline = time.monotonic() + 30
    last = None
    while time.monotonic() < deadline:
        last = stub.LookupRoute(
            pb.LookupRouteRequest(model_id=MODEL, tenant_id="default", hash_scheme="vllm",
                                  token_ids=tokens),
            timeout=5,
        )
        if last.reason_code == "PREFIX_MATCH" and [s.replica_id for s in last.replica_scores] == [
            replica
        ]:
            return
        time.sleep(0.1)
    raise AssertionError(f"the containers never indexed the prompt: {last}")


def test_serve_subscribe_and_gateway_containers_answer_on_loopback(docker: Dockerd) -> None:
    """serve and subscribe in containers, a fake engine on the host: gRPC health and /metrics
    from the host, then a lookup that finds the prompt the engine stored."""
    docker.run(*HARDENED, IMAGE, "serve", "--grpc-address", "127.0.0.1:0",
               "--http-address", "127.0.0.1:0", "--block-size", str(BLOCK), name="ic-serve")
    rec = docker.wait_log("ic-serve", "serving")
    grpc_address, http_address = rec["grpc_address"], rec["http_address"]
    assert rec["block_size"] == BLOCK

    with grpc.insecure_channel(grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
        resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        status, text = http_get(f"http://{http_address}/metrics")
        assert status == 200 and "inferencecache_server_up 1.0" in text
        assert http_get(f"http://{http_address}/readyz") == (200, "ok\n")

        with Children() as children:
            engine = children.start(
                "fake-engine", "--mode", "script", "--script", "-", "--bind",
                "tcp://127.0.0.1:0", "--http-address", "127.0.0.1:0", "--block-size",
                str(BLOCK), stdin=True,
            )
            ready = engine.wait_log("fake engine ready", timeout=30)
            docker.run(
                *HARDENED, IMAGE, "subscribe", "--replica-id", "pod-0", "--model-id", MODEL,
                "--engine-endpoint", ready["endpoint"], "--server", grpc_address,
                "--metrics-address", "127.0.0.1:0", "--window", "20ms", "--block-size",
                str(BLOCK), "--engine-metrics-url", f"http://{ready['http_address']}/metrics",
                name="ic-subscribe",
            )
            sub = docker.wait_log("ic-subscribe", "metrics listening")
            rng = random.Random(12)
            tokens = [rng.randrange(1, 50_000) for _ in range(6 * BLOCK)]
            stub = pb_grpc.InferenceCacheStub(channel)  # type: ignore[no-untyped-call]
            deadline = time.monotonic() + 30
            while True:  # ZeroMQ slow joiner: store until the subscriber has seen a batch
                engine.send(json.dumps({"op": "store", "tokens": tokens}))
                _, text = http_get(f"http://{sub['address']}/metrics")
                if "inferencecache_subscriber_batches_received_total 0.0" not in text:
                    break
                assert time.monotonic() < deadline, "the subscriber container saw no batch"
                time.sleep(0.2)
            wait_serving(stub, tokens, "pod-0")

            docker.run(
                *HARDENED, IMAGE, "gateway", "--engines",
                f"pod-0=http://{ready['http_address']}", "--server", grpc_address,
                "--http-address", "127.0.0.1:0", "--block-size", str(BLOCK),
                "--discover-models=false", name="ic-gateway",
            )
            gw = docker.wait_log("ic-gateway", "serving")
            status, text = http_get(f"http://{gw['http_address']}/metrics")
            assert status == 200 and "inferencecache_gateway_requests" in text
