"""``rediss://``: the event log over TLS against a real redis-server with a throwaway CA made
by openssl (the CA trusted through the URL's ``ssl_ca_certs``, docs/event-log.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from inferencecache.eventlog import (
    EventLogConfig,
    EventLogMetrics,
    LogNode,
    LogUnavailable,
    codec,
)
from inferencecache.index import Index, IndexSettings
from inferencecache.procs import RedisServer, free_port
from inferencecache.v1alpha1 import inferencecache_pb2 as pb


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr",
                                                  "srv.pem"))
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out",
        str(ca), "-days", "1", "-subj", "/CN=test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj",
        "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(crt), "-days", "1", "-extfile", str(ext))
    return ca, crt, key


def test_event_log_over_tls(tmp_path: Path) -> None:
    ca, crt, key = make_certs(tmp_path)
    tls_port = free_port()
    rdir = tmp_path / "redis"
    rdir.mkdir()
    with RedisServer(str(rdir), extra_args=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(crt), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
    ]):
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}"
        idx = Index(IndexSettings())
        node = LogNode(idx, EventLogConfig(url), EventLogMetrics())
        node.start()
        try:
            upd = pb.CacheStateUpdate(replica_id="r", model_id="m", tenant_id="t",
                                      hash_scheme="s",
                                      prefixes=[pb.PrefixEntry(prefix_hash=b"12345678",
                                                               token_count=16)])
            node.submit(codec.KIND_UPDATE, upd.SerializeToString()).result(10)
            assert node.follower.wait_for(1, 10)
            assert idx.counts()["holds"] == 1
        finally:
            node.stop()
        # the server's certificate is verified: without the CA the append fails
        untrusted = LogNode(Index(IndexSettings()),
                            EventLogConfig(f"rediss://127.0.0.1:{tls_port}/0"), EventLogMetrics())
        untrusted.start()
        try:
            with pytest.raises(LogUnavailable):
                untrusted.submit(codec.KIND_TICK, b"").result(10)
        finally:
            untrusted.stop()
