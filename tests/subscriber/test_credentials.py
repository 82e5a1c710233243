"""The subscriber's gRPC client with credentials (issue 15): a refused credential is an RPC
failure the forwarder retries later, logged as such; the right one is accepted, also over TLS."""

from __future__ import annotations

from pathlib import Path

import grpc
import grpc.aio
import pytest

from inferencecache.channels import ChannelSecurity
from inferencecache.server.auth import token_sha256
from inferencecache.server.testing import running_server
from inferencecache.server.tls import TlsFiles
from inferencecache.subscriber.client import CacheClient, describe_error
from inferencecache.subscriber.messages import PREFIX_EVICTED, build_event, build_update
from tests.subscriber.test_forwarder import IDENT, entry
from tests.tlscerts import CA


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    creds = tmp_path / "credentials"
    creds.write_text(f"sidecar producer tenant-t {token_sha256('sc-secret')}\n"
                     f"other producer elsewhere {token_sha256('other-secret')}\n")  # fmt: skip
    good, other = tmp_path / "good", tmp_path / "other"
    good.write_text("sc-secret\n")
    other.write_text("other-secret\n")
    return {"creds": creds, "good": good, "other": other}


async def test_refused_credentials_fail_the_call_with_a_clear_reason(
    files: dict[str, Path], tmp_path: Path
) -> None:
    ca = CA(tmp_path)
    cert = ca.issue("server", server=True)
    tls = TlsFiles(str(cert.cert_file), str(cert.key_file))
    with running_server(credentials_file=str(files["creds"]), tls=tls) as srv:
        update = build_update(IDENT, [entry(1)], 5)
        event = build_event(IDENT, PREFIX_EVICTED, 6, entry(1)[0])
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                            (files["other"], grpc.StatusCode.PERMISSION_DENIED)):  # fmt: skip
            sec = ChannelSecurity(auth_token_file=str(token) if token else "",
                                  tls_ca_file=str(ca.file))  # fmt: skip
            client = CacheClient(srv.grpc_target, security=sec)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.report(update)
                assert e.value.code() == code
                assert "refused this sidecar's credential" in describe_error(e.value)
                assert "retrying later" in describe_error(e.value)
                with pytest.raises(grpc.aio.AioRpcError):
                    await client.publish(event)
            finally:
                await client.close()
        sec = ChannelSecurity(auth_token_file=str(files["good"]), tls_ca_file=str(ca.file))
        client = CacheClient(srv.grpc_target, security=sec)
        try:
            assert (await client.report(update)).accepted
            assert srv.backend.index.counts()["holds"] == 1
            assert (await client.publish(event)).accepted
        finally:
            await client.close()
        assert srv.backend.index.counts()["holds"] == 0  # stored, then evicted by the event


async def test_a_renewed_client_certificate_is_used_without_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cert-manager renews the sidecar's certificate (here with a new name, and the old name
    revoked at the same time): the next call opens a new connection with the new certificate;
    the connectivity watcher follows the new channel without calling it a loss."""
    import asyncio

    from inferencecache import channels
    from inferencecache.server import auth
    from inferencecache.subscriber.resync import watch_connectivity

    monkeypatch.setattr(channels, "TLS_CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(auth, "RELOAD_EVERY_S", 0.0)
    ca = CA(tmp_path)
    cert = ca.issue("server", server=True)
    ca.issue("sidecar-old", server=False, stem="client")
    creds = tmp_path / "credentials"
    creds.write_text("old producer tenant-t cert:sidecar-old\n")
    tls = TlsFiles(str(cert.cert_file), str(cert.key_file), str(ca.file))
    with running_server(credentials_file=str(creds), tls=tls) as srv:
        sec = ChannelSecurity(tls_ca_file=str(ca.file), tls_cert_file=str(tmp_path / "client.pem"),
                              tls_key_file=str(tmp_path / "client.key"))  # fmt: skip
        client = CacheClient(srv.grpc_target, deadline=1.0, security=sec)
        backs: list[int] = []
        watcher = asyncio.create_task(watch_connectivity(
            client.channel, lambda: backs.append(1), lambda: client.channel))
        try:
            update = build_update(IDENT, [entry(1)], 5)
            assert (await client.report(update)).accepted
            first = client.channel
            ca.issue("sidecar-new", server=False, stem="client")
            creds.write_text("new producer tenant-t cert:sidecar-new\n")
            await asyncio.sleep(0.05)
            assert (await client.report(update)).accepted  # the old name would be refused
            assert client.channel is not first
            await asyncio.sleep(1.5)  # the old channel closes after the deadline
            assert not watcher.done() and backs == []
        finally:
            watcher.cancel()
            await client.close()
