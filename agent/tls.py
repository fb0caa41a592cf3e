"""TLS 1.3 with mutual authentication by the job's secret: what seals the checkpoint service's
connections (every byte after the handshake, bulk included, is encrypted and authenticated).

Every process of a job derives the same credentials from the job's key K, with the
standard library alone (the injected agent has nothing else):

* an Ed25519 private key, its seed ``HMAC-SHA256(K, "kelastic-v1 tls ed25519 key")``;
* a self-signed X.509 v3 certificate of that key (:func:`certificate`: minimal DER, signed
  with :mod:`kelastic.agent.ed25519`; deterministic, so every process makes the same bytes).

Both ends present that certificate and trust only it (``CERT_REQUIRED`` on both sides, TLS
1.3 and nothing older): a TLS handshake completes only between two holders of the job's
key, and whoever lacks it (a relay, a stranger) sees ciphertext only and cannot change a
byte undetected. Which node a client reached is what :mod:`kelastic.agent.auth`'s handshake,
run inside the TLS connection, then proves (the server's identity is in its MAC'd answer).

The key reaches OpenSSL through a 0600 file in a private temporary folder that is removed
as soon as the context loaded it (``load_cert_chain`` takes only paths). Contexts are made
once per process and key (:func:`server_context`, :func:`client_context`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import ssl
import tempfile
import threading

from kelastic.agent import ed25519

__all__ = ["certificate", "client_context", "private_key_pem", "server_context"]

_ED25519_OID = bytes.fromhex("06032b6570")  # 1.3.101.112
_CN_OID = bytes.fromhex("0603550403")  # 2.5.4.3
_BASIC_CONSTRAINTS_OID = bytes.fromhex("0603551d13")  # 2.5.29.19
_KEY_USAGE_OID = bytes.fromhex("0603551d0f")  # 2.5.29.15


def _der(tag: int, body: bytes) -> bytes:
    n = len(body)
    if n < 0x80:
        length = bytes([n])
    else:
        raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
        length = bytes([0x80 | len(raw)]) + raw
    return bytes([tag]) + length + body


def _seq(*items: bytes) -> bytes:
    return _der(0x30, b"".join(items))


def _seed(key: bytes) -> bytes:
    return hmac.digest(key, b"kelastic-v1 tls ed25519 key", "sha256")


def certificate(key: bytes) -> bytes:
    """The job's certificate (DER) for the job's key ``key``: self-signed, Ed25519,
    valid from 2020 to 9999, its subject ``kelastic job <fingerprint of the public key>``."""
    seed = _seed(key)
    public = ed25519.public_key(seed)
    algorithm = _seq(_ED25519_OID)
    cn = "kelastic job " + hashlib.sha256(public).hexdigest()[:16]
    name = _seq(_der(0x31, _seq(_CN_OID, _der(0x0C, cn.encode()))))
    validity = _seq(_der(0x17, b"200101000000Z"), _der(0x18, b"99991231235959Z"))
    spki = _seq(algorithm, _der(0x03, b"\x00" + public))
    critical = _der(0x01, b"\xff")
    extensions = _der(
        0xA3,
        _seq(
            _seq(_BASIC_CONSTRAINTS_OID, critical, _der(0x04, _seq(_der(0x01, b"\xff")))),  # CA:TRUE
            # digitalSignature, keyCertSign
            _seq(_KEY_USAGE_OID, critical, _der(0x04, _der(0x03, b"\x02\x84"))),
        ),
    )
    serial = _der(0x02, b"\x01" + hashlib.sha256(public).digest()[:15])
    tbs = _seq(_der(0xA0, _der(0x02, b"\x02")), serial, algorithm, name, validity, name, spki, extensions)
    return _seq(tbs, algorithm, _der(0x03, b"\x00" + ed25519.sign(seed, tbs)))


def private_key_pem(key: bytes) -> bytes:
    """The job's Ed25519 private key as PKCS#8 PEM (OpenSSL derives the public key)."""
    pkcs8 = _seq(_der(0x02, b"\x00"), _seq(_ED25519_OID), _der(0x04, _der(0x04, _seed(key))))
    return _pem("PRIVATE KEY", pkcs8)


def _pem(label: str, der: bytes) -> bytes:
    body = base64.encodebytes(der).decode().replace("\n", "")
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return "\n".join([f"-----BEGIN {label}-----", *lines, f"-----END {label}-----", ""]).encode()


def _context(key: bytes, purpose: int) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose == 0 else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # the peer is identified by the job's certificate, then by auth's answer
    ctx.verify_mode = ssl.CERT_REQUIRED
    cert = certificate(key)
    folder = tempfile.mkdtemp(prefix="kelastic-tls-")  # 0700, this process's own
    try:
        path = os.path.join(folder, "job.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_pem("CERTIFICATE", cert) + private_key_pem(key))
        ctx.load_cert_chain(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ctx.load_verify_locations(cadata=cert)
    if purpose == 0:
        ctx.num_tickets = 0  # no resumption: every connection proves the key afresh
    return ctx


_lock = threading.Lock()
_contexts: dict[tuple[int, int, bytes], ssl.SSLContext] = {}


def _cached(key: bytes, purpose: int) -> ssl.SSLContext:
    digest = hashlib.sha256(key).digest()
    k = (os.getpid(), purpose, digest)
    with _lock:
        ctx = _contexts.get(k)
        if ctx is None:
            ctx = _contexts[k] = _context(key, purpose)
        return ctx


def server_context(key: bytes) -> ssl.SSLContext:
    """The context a service wraps accepted connections in (made once per process and key)."""
    return _cached(key, 0)


def client_context(key: bytes) -> ssl.SSLContext:
    """The context a client wraps its connections in (made once per process and key)."""
    return _cached(key, 1)
