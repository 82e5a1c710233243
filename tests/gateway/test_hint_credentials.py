"""The gateway's hint clients with credentials (issue 15): a refused credential means "no
hint" for that request (routing goes on) and a log line saying why; the right one hints."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from inferencecache import fingerprint
from inferencecache.channels import ChannelSecurity
from inferencecache.gateway.hints import HintClient, HttpHintClient
from inferencecache.routing import reasons
from inferencecache.server.auth import token_sha256
from inferencecache.server.testing import running_server
from tests.gateway.support import report

P = list(range(1000, 1064))


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_refused_credential_is_no_hint_and_logged(
    transport: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    creds = tmp_path / "credentials"
    creds.write_text(f"gw reader default {token_sha256('gw')}\n"
                     f"writer producer default {token_sha256('w')}\n"
                     f"other reader elsewhere {token_sha256('o')}\n")  # fmt: skip
    good, other = tmp_path / "good", tmp_path / "other"
    good.write_text("gw")
    other.write_text("o")
    chain = b"".join(fingerprint.chain(P, 16)[0])
    with running_server(credentials_file=str(creds), lookup_http=True) as srv:
        srv.stub().ReportCacheState(iter([report("r1", P)]), timeout=5,
                                    metadata=(("authorization", "Bearer w"),))  # fmt: skip

        def make(token: Path | None) -> HintClient | HttpHintClient:
            sec = ChannelSecurity(auth_token_file=str(token) if token else "")
            if transport == "http":
                return HttpHintClient(srv.lookup_url, 5.0, "vllm", 16, sec)
            return HintClient(srv.grpc_target, 5.0, "vllm", 16, sec)

        for token in (None, other):
            client = make(token)
            await client.start()
            try:
                with caplog.at_level(logging.WARNING, logger="inferencecache.gateway"):
                    hint = await client.lookup("default", "m", "", chain)
                assert hint.reason_code == reasons.HINT_ERROR
                errs = [getattr(r, "err", "") for r in caplog.records
                        if r.name == "inferencecache.gateway"]  # fmt: skip
                assert any("refused the gateway's credential" in e for e in errs), errs
                assert not [r for r in caplog.records if "dropped" in r.getMessage()]
                caplog.clear()
            finally:
                await client.close()
        client = make(good)
        await client.start()
        try:
            hint = await client.lookup("default", "m", "", chain)
            assert hint.reason_code == "PREFIX_MATCH"
        finally:
            await client.close()


async def test_a_renewed_client_certificate_is_used_without_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inferencecache import channels
    from inferencecache.server import auth
    from inferencecache.server.tls import TlsFiles
    from tests.tlscerts import CA

    monkeypatch.setattr(channels, "TLS_CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(auth, "RELOAD_EVERY_S", 0.0)
    ca = CA(tmp_path)
    cert = ca.issue("server", server=True)
    ca.issue("gateway-old", server=False, stem="client")
    creds = tmp_path / "credentials"
    creds.write_text(f"old reader default cert:gateway-old\nw producer default "
                     f"{token_sha256('w')}\n")  # fmt: skip
    chain = b"".join(fingerprint.chain(P, 16)[0])
    tls = TlsFiles(str(cert.cert_file), str(cert.key_file), str(ca.file))
    with running_server(credentials_file=str(creds), tls=tls) as srv:
        w = ChannelSecurity(tls_ca_file=str(ca.file), tls_cert_file=str(tmp_path / "client.pem"),
                            tls_key_file=str(tmp_path / "client.key"))  # fmt: skip
        with w.channel(srv.grpc_target) as ch:
            from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

            pb_grpc.InferenceCacheStub(ch).ReportCacheState(  # type: ignore[no-untyped-call]
                iter([report("r1", P)]), timeout=5, metadata=(("authorization", "Bearer w"),))
        client = HintClient(srv.grpc_target, 5.0, "vllm", 16, w)
        await client.start()
        try:
            assert (await client.lookup("default", "m", "", chain)).reason_code == "PREFIX_MATCH"
            ca.issue("gateway-new", server=False, stem="client")
            creds.write_text("new reader default cert:gateway-new\n")
            assert (await client.lookup("default", "m", "", chain)).reason_code == "PREFIX_MATCH"
        finally:
            await client.close()
