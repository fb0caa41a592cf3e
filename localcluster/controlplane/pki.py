"""Certificates and keys of a local control plane, made with ``cryptography``.

A control plane needs a cluster CA (serving certificate of the API server,
client certificates of every component and of the admin), a separate
front-proxy CA (the aggregation layer's request-header authentication) and
the service-account signing key. Everything here is ECDSA P-256: generating
a dozen keys takes milliseconds, where RSA would take seconds.

Files are written as ``<dir>/<name>.crt`` / ``<dir>/<name>.key`` (keys
mode 0600) and reused when they already exist, so a control plane restarted
on the same state directory keeps its identity (and kubeconfigs stay valid).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertPair", "ensure_ca", "ensure_leaf", "ensure_signing_key"]

#: Certificates live long enough for any local cluster; nothing here is exposed beyond loopback.
VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class CertPair:
    """Paths of one certificate and its private key (PEM)."""

    cert: Path
    key: Path

    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    def key_pem(self) -> bytes:
        return self.key.read_bytes()


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path} is not an ECDSA key; remove it to have it generated again")
    return key


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _now() -> datetime.datetime:
    # Backdated a little: a certificate must already be valid for a peer whose clock is behind.
    return datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)


def ensure_ca(directory: Path, name: str, common_name: str) -> CertPair:
    """A self-signed CA ``<name>.crt``/``<name>.key`` in ``directory`` (kept if present)."""
    pair = CertPair(directory / f"{name}.crt", directory / f"{name}.key")
    if pair.cert.is_file() and pair.key.is_file():
        return pair
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(common_name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(pair.key, key)
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pair


def ensure_leaf(
    ca: CertPair,
    directory: Path,
    name: str,
    common_name: str,
    *,
    organizations: tuple[str, ...] = (),
    server: bool = False,
    client: bool = False,
    hosts: tuple[str, ...] = (),
) -> CertPair:
    """A certificate signed by ``ca`` (kept if present).

    ``common_name`` and ``organizations`` are the Kubernetes user and groups of
    a client certificate; ``hosts`` (IP addresses or DNS names) are the
    subject alternative names of a serving certificate.
    """
    pair = CertPair(directory / f"{name}.crt", directory / f"{name}.key")
    if pair.cert.is_file() and pair.key.is_file():
        return pair
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _load_key(ca.key)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_key(pair.key, key)
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pair


def ensure_signing_key(directory: Path, name: str) -> CertPair:
    """A bare key pair (``<name>.key`` private, ``<name>.pub`` public), e.g. to sign service-account tokens."""
    pair = CertPair(directory / f"{name}.pub", directory / f"{name}.key")
    if pair.cert.is_file() and pair.key.is_file():
        return pair
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    _write_key(pair.key, key)
    pair.cert.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pair
