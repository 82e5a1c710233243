"""Certificates for the TLS tests, generated per test with ``cryptography`` (never committed):
a CA, server certificates for 127.0.0.1/localhost and client certificates by common name."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@dataclass
class Issued:
    cert_file: Path
    key_file: Path
    serial: int


class CA:
    """A self-signed CA that issues server and client certificates into ``dir``."""

    def __init__(self, dir: Path, name: str = "test-ca") -> None:
        self.dir = dir
        self.name = name
        self.key = _key()
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.file = dir / f"{name}.pem"
        self.file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, *, server: bool, stem: str | None = None) -> Issued:
        """A leaf certificate: server ones name 127.0.0.1 and localhost; files ``<stem>.pem``
        and ``<stem>.key`` (overwritten: what a rotation does)."""
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        serial = x509.random_serial_number()
        sans: list[x509.GeneralName] = [x509.DNSName(cn)]
        if server:
            sans += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        stem = stem or cn
        cert_file, key_file = self.dir / f"{stem}.pem", self.dir / f"{stem}.key"
        # key first, then the certificate: a reader that sees the new certificate also finds
        # its key (cert-manager swaps both at once through a symlink)
        tmp_key, tmp_cert = key_file.with_suffix(".key.tmp"), cert_file.with_suffix(".pem.tmp")
        tmp_key.write_bytes(_pem_key(key))
        tmp_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        tmp_key.replace(key_file)
        tmp_cert.replace(cert_file)
        return Issued(cert_file, key_file, serial)
