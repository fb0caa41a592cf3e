"""Ed25519 (RFC 8032) key derivation and signing in pure Python: what :mod:`kelastic.agent.tls`
needs to sign the job's certificate, once per process.

The injected agent may import only the standard library and torch, which have no Ed25519
signer, so this is RFC 8032's algorithm over Python integers (extended twisted Edwards
coordinates). It signs one certificate per process (a few milliseconds); it is not
constant-time, which does not matter here: what it signs and with which key is the same
in every process of the job, and the key comes from the job's secret, which every process
that runs this already holds. OpenSSL does every signature of the TLS handshakes.
"""

from __future__ import annotations

import hashlib

__all__ = ["public_key", "sign"]

_P = 2**255 - 19
_L = 2**252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)

_Point = tuple[int, int, int, int]  # extended coordinates (X, Y, Z, T), x = X/Z, y = Y/Z, xy = T/Z


def _add(p: _Point, q: _Point) -> _Point:
    a = (p[1] - p[0]) * (q[1] - q[0]) % _P
    b = (p[1] + p[0]) * (q[1] + q[0]) % _P
    c = 2 * p[3] * q[3] * _D % _P
    d = 2 * p[2] * q[2] % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return e * f % _P, g * h % _P, f * g % _P, e * h % _P


def _mul(s: int, p: _Point) -> _Point:
    q: _Point = (0, 1, 1, 0)  # the neutral element
    while s > 0:
        if s & 1:
            q = _add(q, p)
        p = _add(p, p)
        s >>= 1
    return q


def _recover_x(y: int, sign: int) -> int:
    x2 = (y * y - 1) * pow(_D * y * y + 1, _P - 2, _P) % _P
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P != 0:
        x = x * _SQRT_M1 % _P
    if x & 1 != sign:
        x = _P - x
    return x


_GY = 4 * pow(5, _P - 2, _P) % _P
_GX = _recover_x(_GY, 0)
_G: _Point = (_GX, _GY, 1, _GX * _GY % _P)


def _encode(p: _Point) -> bytes:
    zinv = pow(p[2], _P - 2, _P)
    x, y = p[0] * zinv % _P, p[1] * zinv % _P
    return int.to_bytes(y | ((x & 1) << 255), 32, "little")


def _sha512_int(*parts: bytes) -> int:
    return int.from_bytes(hashlib.sha512(b"".join(parts)).digest(), "little")


def _expand(seed: bytes) -> tuple[int, bytes]:
    if len(seed) != 32:
        raise ValueError(f"an Ed25519 private key is 32 bytes, not {len(seed)}")
    h = hashlib.sha512(seed).digest()
    a = int.from_bytes(h[:32], "little")
    a &= (1 << 254) - 8
    a |= 1 << 254
    return a, h[32:]


def public_key(seed: bytes) -> bytes:
    """The 32-byte public key of the private key ``seed`` (32 bytes)."""
    a, _ = _expand(seed)
    return _encode(_mul(a, _G))


def sign(seed: bytes, message: bytes) -> bytes:
    """The 64-byte Ed25519 signature of ``message`` under the private key ``seed``."""
    a, prefix = _expand(seed)
    pub = _encode(_mul(a, _G))
    r = _sha512_int(prefix, message) % _L
    big_r = _encode(_mul(r, _G))
    k = _sha512_int(big_r, pub, message) % _L
    s = (r + k * a) % _L
    return big_r + int.to_bytes(s, 32, "little")
