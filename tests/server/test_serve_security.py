"""``serve`` and the client commands as processes with credentials and TLS flags (issue 15)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferencecache.procs import Children, run_cli
from inferencecache.server.auth import token_sha256
from tests.tlscerts import CA


@pytest.fixture
def procs() -> Iterator[Children]:
    with Children() as started:
        yield started


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_bad_input_non_loopback_grpc_without_auth_exits_2(tmp_path: Path) -> None:
    token = tmp_path / "admin"
    token.write_text("admin-token")
    res = run_cli(["serve", "--grpc-address", "0.0.0.0:0", "--http-address", "127.0.0.1:0",
                   "--admin-token-file", str(token)])  # fmt: skip
    assert res.returncode == 2
    line = one_error_line(res.stderr)
    assert "--grpc-address 0.0.0.0:0" in line and "--insecure-disable-auth" in line


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--credentials-file", "/nonexistent/creds"], "/nonexistent/creds"),
        (["--tls-cert-file", "/nonexistent/c.pem"], "go together"),
        (["--tls-cert-file", "/nonexistent/c.pem", "--tls-key-file", "/nonexistent/k.pem"],
         "--tls-cert-file"),
        (["--max-tenants", "-1"], "--max-tenants"),
    ],
)
def test_bad_input_security_flags_exit_2_with_one_line(extra: list[str], needle: str) -> None:
    res = run_cli(["serve", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
                   *extra])  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert needle in one_error_line(res.stderr)


def test_bad_input_credentials_file_syntax_exits_2(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.write_text("a writer * cert:x\n")
    res = run_cli(["serve", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
                   "--credentials-file", str(creds)])  # fmt: skip
    assert res.returncode == 2
    assert "line 1" in one_error_line(res.stderr)


def test_serve_tls_with_tokens_and_the_lookup_command(procs: Children, tmp_path: Path) -> None:
    """serve with TLS + credentials off loopback (every flag through the environment), and
    ``inferencecache lookup`` with --auth-token-file / --tls-ca-file against it."""
    ca = CA(tmp_path)
    srv = ca.issue("server", server=True)
    creds = tmp_path / "credentials"
    creds.write_text(f"cli reader t {token_sha256('cli-secret')}\n")
    token = tmp_path / "token"
    token.write_text("cli-secret\n")
    admin = tmp_path / "admin"
    admin.write_text("admin-secret")
    env = {
        "INFERENCECACHE_ADMIN_TOKEN_FILE": str(admin),
        "INFERENCECACHE_GRPC_ADDRESS": "0.0.0.0:0",
        "INFERENCECACHE_HTTP_ADDRESS": "127.0.0.1:0",
        "INFERENCECACHE_CREDENTIALS_FILE": str(creds),
        "INFERENCECACHE_TLS_CERT_FILE": str(srv.cert_file),
        "INFERENCECACHE_TLS_KEY_FILE": str(srv.key_file),
    }
    p = procs.start("serve", env=env, inherit=False)
    rec = p.wait_log("serving")
    assert rec["grpc_auth"] is True and rec["grpc_tls"] is True
    target = f"127.0.0.1:{rec['grpc_address'].rsplit(':', 1)[1]}"
    base = ["lookup", "--server", target, "--model-id", "m", "--tenant-id", "t", "--tokens",
            "1,2,3"]  # fmt: skip
    ok = run_cli([*base, "--auth-token-file", str(token)],
                 env={"INFERENCECACHE_TLS_CA_FILE": str(ca.file)})  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["reason_code"]
    denied = run_cli([*base, "--tls-ca-file", str(ca.file)])
    assert denied.returncode != 0 and "UNAUTHENTICATED" in denied.stderr
    other = run_cli([*base[:-4], "--tenant-id", "x", "--tokens", "1", "--tls-ca-file",
                     str(ca.file), "--auth-token-file", str(token)])  # fmt: skip
    assert other.returncode != 0 and "PERMISSION_DENIED" in other.stderr
    bad = run_cli([*base, "--auth-token-file", str(tmp_path / "missing")])
    assert bad.returncode == 2 and "--auth-token-file" in one_error_line(bad.stderr)


def test_insecure_disable_auth_allows_a_plain_public_listener(
    procs: Children, tmp_path: Path
) -> None:
    admin = tmp_path / "admin"
    admin.write_text("admin-secret")
    p = procs.start("serve", "--grpc-address", "0.0.0.0:0", "--http-address", "127.0.0.1:0",
                    "--admin-token-file", str(admin), "--insecure-disable-auth",
                    inherit=False)  # fmt: skip
    rec = p.wait_log("serving")
    assert rec["grpc_auth"] is False and rec["grpc_tls"] is False
