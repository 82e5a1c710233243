"""TLS and mTLS on the gRPC listener (issue 15 item 3): real handshakes on 127.0.0.1 with
certificates generated per test, a rotation under live traffic, a client with the wrong CA."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from inferencecache.channels import ChannelSecurity
from inferencecache.server.auth import token_sha256
from inferencecache.server.testing import RunningServer, running_server
from inferencecache.server.tls import ReloadingServerCredentials, TlsConfigError, TlsFiles
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc
from tests.server.helpers import (
    CONFIG,
    chain_entry,
    lookup_chain,
    one_shot,
    tokens,
    update,
    wait_for,
)
from tests.tlscerts import CA, Issued


@pytest.fixture
def ca(tmp_path: Path) -> CA:
    return CA(tmp_path)


@pytest.fixture
def server_cert(ca: CA) -> Issued:
    return ca.issue("inferencecache-server", server=True, stem="server")


def stub(target: str, sec: ChannelSecurity) -> tuple[grpc.Channel, pb_grpc.InferenceCacheStub]:
    ch = sec.channel(target)
    return ch, pb_grpc.InferenceCacheStub(ch)  # type: ignore[no-untyped-call]


def presented_serial(port: int, ca_file: Path) -> int:
    """The serial of the certificate the server presents to a new TLS handshake."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:  # fmt: skip
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


@pytest.fixture
def tls_srv(server_cert: Issued) -> Iterator[RunningServer]:
    with running_server(config=CONFIG,
                        tls=TlsFiles(str(server_cert.cert_file), str(server_cert.key_file))) as s:
        yield s  # fmt: skip


def test_tls_lookup_and_the_gauge(tls_srv: RunningServer, ca: CA) -> None:
    ch, st = stub(tls_srv.grpc_target, ChannelSecurity(tls_ca_file=str(ca.file)))
    with ch:
        toks = tokens(32)
        assert st.ReportCacheState(one_shot(update("r1", [chain_entry(toks)])), timeout=10).accepted
        assert st.LookupRoute(lookup_chain(toks), timeout=10).reason_code == "PREFIX_MATCH"
    assert tls_srv.metrics.registry.get_sample_value("inferencecache_server_grpc_tls_enabled") == 1


def test_plaintext_server_reports_tls_off() -> None:
    with running_server() as s:
        assert s.metrics.registry.get_sample_value("inferencecache_server_grpc_tls_enabled") == 0


def test_bad_input_client_with_the_wrong_ca_fails(tls_srv: RunningServer, tmp_path: Path) -> None:
    other = CA(tmp_path, name="other-ca")
    ch, st = stub(tls_srv.grpc_target, ChannelSecurity(tls_ca_file=str(other.file)))
    with ch, pytest.raises(grpc.RpcError) as e:
        st.LookupRoute(lookup_chain(tokens(16)), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # and a plaintext client cannot talk to the TLS listener either
    with grpc.insecure_channel(tls_srv.grpc_target) as plain, pytest.raises(grpc.RpcError):
        pb_grpc.InferenceCacheStub(plain).LookupRoute(  # type: ignore[no-untyped-call]
            lookup_chain(tokens(16)), timeout=5)


def test_mtls_requires_a_client_certificate_and_maps_it_to_a_credential(
    ca: CA, server_cert: Issued, tmp_path: Path
) -> None:
    edge = ca.issue("edge-1", server=False)
    stranger = ca.issue("stranger", server=False)
    creds = tmp_path / "credentials"
    creds.write_text(f"edge reader t cert:edge-1\nops admin * {token_sha256('ops')}\n")
    files = TlsFiles(str(server_cert.cert_file), str(server_cert.key_file), str(ca.file))
    with running_server(config=CONFIG, tls=files, credentials_file=str(creds)) as s:
        assert s.metrics.registry.get_sample_value("inferencecache_server_grpc_tls_enabled") == 2
        no_cert = ChannelSecurity(tls_ca_file=str(ca.file))
        ch, st = stub(s.grpc_target, no_cert)
        with ch, pytest.raises(grpc.RpcError) as e:
            st.LookupRoute(lookup_chain(tokens(16)), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails
        sec = ChannelSecurity(tls_ca_file=str(ca.file), tls_cert_file=str(edge.cert_file),
                              tls_key_file=str(edge.key_file))  # fmt: skip
        ch, st = stub(s.grpc_target, sec)
        with ch:
            assert st.LookupRoute(lookup_chain(tokens(16)), timeout=10).reason_code != ""
            with pytest.raises(grpc.RpcError) as e:
                st.LookupRoute(lookup_chain(tokens(16), tenant="other"), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as e:
                st.ReportCacheState(one_shot(update("r1", [chain_entry(tokens(16))])), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED  # a reader only
        sec = ChannelSecurity(tls_ca_file=str(ca.file), tls_cert_file=str(stranger.cert_file),
                              tls_key_file=str(stranger.key_file))  # fmt: skip
        ch, st = stub(s.grpc_target, sec)
        with ch, pytest.raises(grpc.RpcError) as e:
            st.LookupRoute(lookup_chain(tokens(16)), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED  # signed, but no credential


def test_mtls_without_a_credentials_file_admits_any_signed_client(
    ca: CA, server_cert: Issued
) -> None:
    client = ca.issue("anyone", server=False)
    files = TlsFiles(str(server_cert.cert_file), str(server_cert.key_file), str(ca.file))
    with running_server(config=CONFIG, tls=files) as s:
        sec = ChannelSecurity(tls_ca_file=str(ca.file), tls_cert_file=str(client.cert_file),
                              tls_key_file=str(client.key_file))  # fmt: skip
        ch, st = stub(s.grpc_target, sec)
        with ch:
            assert st.ReportCacheState(one_shot(update("r1", [chain_entry(tokens(16))])),
                                       timeout=10).accepted  # fmt: skip


def test_rotation_under_live_traffic(tls_srv: RunningServer, ca: CA, server_cert: Issued) -> None:
    """Lookups on an open connection keep succeeding while the files are swapped; new
    handshakes see the new certificate; a swap to a broken pair keeps the current one."""
    toks = tokens(32)
    ch, st = stub(tls_srv.grpc_target, ChannelSecurity(tls_ca_file=str(ca.file)))
    port = tls_srv.server.grpc_port
    with ch:
        assert st.ReportCacheState(one_shot(update("r1", [chain_entry(toks)])), timeout=10).accepted
        assert presented_serial(port, ca.file) == server_cert.serial
        stop = threading.Event()
        answers: list[str] = []
        errors: list[BaseException] = []

        def traffic() -> None:
            while not stop.is_set():
                try:
                    answers.append(st.LookupRoute(lookup_chain(toks), timeout=10).reason_code)
                except BaseException as e:  # recorded, asserted below
                    errors.append(e)
                    return

        t = threading.Thread(target=traffic, daemon=True)
        t.start()
        try:
            wait_for(lambda: len(answers) >= 5)
            rotated = ca.issue("inferencecache-server", server=True, stem="server")
            assert wait_for(lambda: presented_serial(port, ca.file) == rotated.serial)
            n = len(answers)
            wait_for(lambda: len(answers) >= n + 5)
            # a broken swap (a key that is not the certificate's) keeps the current pair
            other = ca.issue("x", server=True, stem="other")
            Path(server_cert.key_file).write_bytes(Path(other.key_file).read_bytes())
            assert presented_serial(port, ca.file) == rotated.serial
            wait_for(lambda: tls_srv.metrics.registry.get_sample_value(
                "inferencecache_server_config_reloads_total", {"file": "tls", "result": "error"}))
        finally:
            stop.set()
            t.join(10)
        assert not errors, errors
        assert set(answers) == {"PREFIX_MATCH"}
    ch2, st2 = stub(tls_srv.grpc_target, ChannelSecurity(tls_ca_file=str(ca.file)))
    with ch2:  # a fresh connection after all this
        assert st2.LookupRoute(lookup_chain(toks), timeout=10).reason_code == "PREFIX_MATCH"


def test_bad_input_tls_files_are_checked_at_start(ca: CA, server_cert: Issued) -> None:
    other = ca.issue("x", server=True, stem="other")
    with pytest.raises(TlsConfigError, match="--tls-cert-file"):
        ReloadingServerCredentials(TlsFiles(str(server_cert.cert_file), str(other.key_file)))
    with pytest.raises(TlsConfigError, match="cannot read --tls-key-file"):
        ReloadingServerCredentials(TlsFiles(str(server_cert.cert_file), "/nonexistent/k"))
    with pytest.raises(ValueError, match="--tls-ca-file"):
        ChannelSecurity(tls_ca_file="/nonexistent/ca").validate()
    with pytest.raises(ValueError, match="go together"):
        ChannelSecurity(tls_ca_file=str(ca.file), tls_cert_file="x").validate()


def test_tls_and_token_together(ca: CA, server_cert: Issued, tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    creds.write_text(f"gw reader t {token_sha256('gw-token')}\n")
    token = tmp_path / "token"
    token.write_text("gw-token\n")
    files = TlsFiles(str(server_cert.cert_file), str(server_cert.key_file))
    with running_server(config=CONFIG, tls=files, credentials_file=str(creds)) as s:
        sec = ChannelSecurity(auth_token_file=str(token), tls_ca_file=str(ca.file))
        ch, st = stub(s.grpc_target, sec)
        with ch:
            resp = st.LookupRoute(lookup_chain(tokens(16)), timeout=10, metadata=sec.metadata())
            assert isinstance(resp, pb.LookupRouteResponse)
            with pytest.raises(grpc.RpcError) as e:
                st.LookupRoute(lookup_chain(tokens(16)), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
