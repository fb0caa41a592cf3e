"""The certificates Kueue's webhook server is started with (Kueue keeps them as its own).

RSA keys in PKCS #1 form: Kueue's certificate management reads its CA key no other way.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kelastic.localcluster.controlplane.pki import CertPair

__all__ = ["CA_NAME", "kueue_certificates"]

#: Kueue's certificate management checks that its CA is valid for this name, and keeps a
#: Secret whose CA and serving certificate pass its checks.
CA_NAME = "kueue-ca"
VALIDITY = datetime.timedelta(days=3650)


def _write(pair: CertPair, cert: x509.Certificate, key: rsa.RSAPrivateKey) -> None:
    pair.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    pair.key.chmod(0o600)
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def kueue_certificates(directory: Path, service_dns: str, ip: str) -> tuple[CertPair, CertPair]:
    """(CA, serving certificate) in ``directory``, made once: the serving one is valid for
    ``service_dns`` (what Kueue checks) and ``ip`` (where the API server calls it)."""
    ca = CertPair(directory / "kueue-ca.crt", directory / "kueue-ca.key")
    leaf = CertPair(directory / "kueue-webhook.crt", directory / "kueue-webhook.key")
    if all(p.is_file() for p in (ca.cert, ca.key, leaf.cert, leaf.key)):
        return ca, leaf
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kueue"),
        ]
    )
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CA_NAME)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, service_dns)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(service_dns), x509.IPAddress(ipaddress.ip_address(ip))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(ca, ca_cert, ca_key)
    _write(leaf, cert, key)
    return ca, leaf
