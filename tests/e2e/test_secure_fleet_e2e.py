"""Fake engine process → subscriber process → server, with TLS, client certificates and
credentials on the gRPC hop (issue 15): the subscriber's flags (from the environment) get its
blocks indexed; a subscriber whose credential is bound to another tenant is refused, says so in
its log and keeps running (retry later)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferencecache.channels import ChannelSecurity
from inferencecache.index.tenant_config import IndexConfig, TenantPolicy
from inferencecache.procs import Children
from inferencecache.server.auth import token_sha256
from inferencecache.server.testing import running_server
from inferencecache.server.tls import TlsFiles
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.server.helpers import wait_for
from tests.tlscerts import CA

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "e2e-model"
BLOCK = 16
OPEN = TenantPolicy(minimum_matched_tokens=0, routing_floor_score=0.0, affinity_routing=False)


@pytest.fixture
def procs() -> Iterator[Children]:
    with Children() as started:
        yield started


def test_subscriber_over_mtls_with_credentials(procs: Children, tmp_path: Path) -> None:
    ca = CA(tmp_path)
    server = ca.issue("server", server=True)
    sidecar = ca.issue("sidecar", server=False)
    creds = tmp_path / "credentials"
    creds.write_text(f"sidecars producer default cert:sidecar\n"
                     f"misplaced producer elsewhere {token_sha256('wrong-tenant')}\n"
                     f"reader reader default {token_sha256('reader')}\n")  # fmt: skip
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong-tenant")
    files = TlsFiles(str(server.cert_file), str(server.key_file), str(ca.file))
    config = IndexConfig(policies={"default": OPEN})
    with running_server(config=config, tls=files, credentials_file=str(creds)) as srv:
        engine = procs.start("fake-engine", "--mode", "script", "--script", "-", "--bind",
                             "tcp://127.0.0.1:0", "--http-address", "127.0.0.1:0",
                             "--block-size", str(BLOCK), stdin=True)  # fmt: skip
        ready = engine.wait_log("fake engine ready", timeout=20)
        common = ["subscribe", "--model-id", MODEL, "--engine-endpoint", ready["endpoint"],
                  "--server", srv.grpc_target, "--metrics-address", "127.0.0.1:0",
                  "--window", "20ms", "--block-size", str(BLOCK), "--engine-metrics-url", ""]
        tls_env = {"INFERENCECACHE_TLS_CA_FILE": str(ca.file),
                   "INFERENCECACHE_TLS_CERT_FILE": str(sidecar.cert_file),
                   "INFERENCECACHE_TLS_KEY_FILE": str(sidecar.key_file)}  # fmt: skip
        good = procs.start(*common, "--replica-id", "good", env=tls_env)
        good.wait_log("connected to the engine", timeout=30)
        # the same certificate, but a token (which wins) bound to another tenant
        bad = procs.start(*common, "--replica-id", "bad", "--auth-token-file", str(wrong),
                          env=tls_env)  # fmt: skip
        # both must see the engine's stores: a batch published before a SUB connected is lost
        bad.wait_log("connected to the engine", timeout=30)
        tokens = [random.Random(7).randrange(1, 100_000) for _ in range(6 * BLOCK)]
        sec = ChannelSecurity(tls_ca_file=str(ca.file), tls_cert_file=str(sidecar.cert_file),
                              tls_key_file=str(sidecar.key_file))  # fmt: skip
        with sec.channel(srv.grpc_target) as ch:
            stub = pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]
            md = (("authorization", "Bearer reader"),)
            req = pb.LookupRouteRequest(model_id=MODEL, tenant_id="default", hash_scheme="vllm",
                                        token_ids=tokens)  # fmt: skip

            def matched() -> list[str]:
                engine.send(json.dumps({"op": "store", "tokens": tokens}))
                resp = stub.LookupRoute(req, timeout=5, metadata=md)
                return [s.replica_id for s in resp.replica_scores]

            assert wait_for(matched, timeout=30, interval=0.3) == ["good"]

            def is_refusal(r: dict[str, Any]) -> bool:
                return "refused this sidecar's credential" in str(r.get("err", ""))

            def refusal_logged() -> bool:
                # a SUB socket's subscription reaches the engine a moment after it connects:
                # store until the refused sidecar has had something to send
                engine.send(json.dumps({"op": "store", "tokens": tokens}))
                return bad.count(is_refusal) > 0

            assert wait_for(refusal_logged, timeout=30, interval=0.3)
            refused = bad.wait_log(is_refusal, timeout=5)
            assert "PERMISSION_DENIED" in refused["err"]
            assert bad.alive() and good.alive()
            with pytest.raises(grpc.RpcError) as e:  # the sidecar's certificate cannot read
                stub.LookupRoute(req, timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
