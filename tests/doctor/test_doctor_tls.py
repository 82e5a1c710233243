"""``doctor`` against a server with TLS, client certificates and credentials (issue 15): with
the client flags its gRPC checks and the probe pass; without them the server is unreachable."""

from __future__ import annotations

from pathlib import Path

from inferencecache.server.auth import token_sha256
from inferencecache.server.testing import running_server
from inferencecache.server.tls import TlsFiles
from tests.doctor.test_doctor_e2e import doctor
from tests.tlscerts import CA


def test_doctor_with_tls_and_a_tenant_bound_credential(tmp_path: Path) -> None:
    ca = CA(tmp_path)
    server = ca.issue("server", server=True)
    client = ca.issue("inferencecache-doctor", server=False)
    creds = tmp_path / "credentials"
    creds.write_text(f"doctor admin some-tenant cert:inferencecache-doctor\n"
                     f"probe admin some-tenant {token_sha256('probe-token')}\n")  # fmt: skip
    token = tmp_path / "token"
    token.write_text("probe-token")
    files = TlsFiles(str(server.cert_file), str(server.key_file), str(ca.file))
    with running_server(tls=files, credentials_file=str(creds)) as srv:
        base = ["--server", srv.grpc_target, "--server-http", srv.http_url, "--timeout", "3s"]
        tls = ["--tls-ca-file", str(ca.file), "--tls-cert-file", str(client.cert_file),
               "--tls-key-file", str(client.key_file)]  # fmt: skip
        for extra in ([], ["--auth-token-file", str(token)]):
            code, verdicts, out = doctor(*base, *tls, *extra)
            assert verdicts["server reachable"] == "PASS", out
            assert verdicts["server healthy"] == "PASS", out
            assert verdicts["probe tenant"] == "PASS", out
            assert "gRPC report acked" in out, out
        code, verdicts, out = doctor(*base)
        assert code == 1 and verdicts["server reachable"] == "FAIL", out
        code, verdicts, out = doctor(*base, "--tls-ca-file", str(tmp_path / "missing.pem"))
        assert code == 2 and "--tls-ca-file" in out, out
