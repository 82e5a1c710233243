"""deploy/overlays/tls: every gRPC hop with TLS and client certificates, wired consistently
(the files each container is told to read are the ones its volumes mount, from the Secrets the
Certificates write; every client certificate maps to a credential of the right role)."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest

from inferencecache.server.auth import parse_credentials
from tests.deploy.manifests import Obj, container_settings, containers, find, is_ours, render


@pytest.fixture(scope="module")
def tls() -> list[Obj]:
    return render("overlays/tls")


def _mounted_secret(workload: Obj, container: Obj, path: str) -> str:
    """The Secret (or ConfigMap) name a file path of ``container`` comes from."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    for m in container.get("volumeMounts", []):
        if PurePosixPath(path).parent == PurePosixPath(m["mountPath"]):
            v = volumes[m["name"]]
            return str(v["secret"]["secretName"] if "secret" in v else v["configMap"]["name"])
    raise AssertionError(f"{container['name']}: {path} is on no mounted volume")


def test_every_grpc_hop_uses_tls_with_a_client_certificate(
    tls: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    certs = {o["spec"]["secretName"]: o for o in tls if o["kind"] == "Certificate"}
    cred_map = find(tls, "ConfigMap", "inferencecache-grpc-credentials")
    creds = {name: c for c in parse_credentials(cred_map["data"]["credentials"])
             for name in c.cert_names}  # fmt: skip
    seen: dict[str, Any] = {}
    for workload, c in containers(tls):
        if not is_ours(c):
            continue
        sub, s = container_settings(tls, c, monkeypatch)
        seen[sub] = s
        if sub == "serve":
            assert not s.insecure_disable_auth
            secret = _mounted_secret(workload, c, s.tls_cert_file)
            assert secret == _mounted_secret(workload, c, s.tls_key_file) == \
                _mounted_secret(workload, c, s.tls_client_ca_file)  # fmt: skip
            assert "inferencecache-server" in certs[secret]["spec"]["dnsNames"]
            assert _mounted_secret(workload, c, s.credentials_file) == \
                "inferencecache-grpc-credentials"  # fmt: skip
            assert "httpGet" in c["livenessProbe"] and "grpc" not in c["readinessProbe"]
            continue
        secret = _mounted_secret(workload, c, s.tls_cert_file)
        assert secret == _mounted_secret(workload, c, s.tls_key_file) == \
            _mounted_secret(workload, c, s.tls_ca_file)  # fmt: skip
        cert = certs[secret]["spec"]
        assert cert["usages"] == ["client auth"]
        cred = creds[cert["commonName"]]
        role = {"subscribe": "producer", "gateway": "reader"}[sub]
        assert cred.roles == {role}
        assert str(s.server).split(":")[0] in certs["inferencecache-server-tls"]["spec"][
            "dnsNames"]
        assert cred.tenants is not None and s.tenant_id.replace("$(POD_NAMESPACE)", "") in (
            "", *cred.tenants)
    assert set(seen) == {"serve", "subscribe", "gateway"}
    issuers = {o["metadata"]["name"] for o in tls if o["kind"] == "Issuer"}
    assert all(c["spec"]["issuerRef"]["name"] in issuers for c in certs.values())


def test_the_example_base_is_plaintext_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    example = render("overlays/example")
    for _, c in containers(example):
        if is_ours(c) and c["args"][0] == "serve":
            _, s = container_settings(example, c, monkeypatch)
            assert s.insecure_disable_auth and not s.tls_cert_file
