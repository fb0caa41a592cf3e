"""Projected service-account tokens: what the kubelet was issued and when it asks for a new one.

A projected ``serviceAccountToken`` source asks for a token that expires
(``expirationSeconds``, 3607 s unless set; the API server refuses less than
600 s). Like the real kubelet's token manager, the process kubelet requests a
new one once 80 % of the token's lifetime has passed (or 24 hours, whichever
comes first), and rewrites the file in the pod's volume, so a long-running pod
never holds an expired token.

The lifetime is reckoned as the real kubelet does: from the expiration the API
server answered (``status.expirationTimestamp``) back by the ``expirationSeconds``
it granted. This module holds the pure decision; the kubelet does the requests
and the writes.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .podstatus import parse_rfc3339

__all__ = [
    "DEFAULT_EXPIRATION_S",
    "MAX_TTL_S",
    "REFRESH_FRACTION",
    "IssuedToken",
    "issued_token",
    "refresh_due",
    "write_atomically",
]

#: ``expirationSeconds`` of a source that sets none (what the API server defaults it to).
DEFAULT_EXPIRATION_S = 3607
#: The share of a token's lifetime after which a new one is requested.
REFRESH_FRACTION = 0.8
#: A token older than this is replaced whatever its lifetime (the real kubelet's cap).
MAX_TTL_S = 24 * 3600


@dataclass(frozen=True)
class IssuedToken:
    """A token of one projected source: where it is written and how long it lives."""

    volume: str
    path: str
    token: str
    #: The lifetime granted, in seconds (the TokenRequest's ``spec.expirationSeconds``).
    expiration_seconds: int
    #: When it expires (seconds since the epoch).
    expires_at: float

    @property
    def issued_at(self) -> float:
        return self.expires_at - self.expiration_seconds

    @property
    def refresh_at(self) -> float:
        """When to request a new token: 80 % into its lifetime, at most 24 h after its issue."""
        lifetime = min(REFRESH_FRACTION * self.expiration_seconds, MAX_TTL_S)
        return self.issued_at + lifetime


def refresh_due(token: IssuedToken, now: float) -> bool:
    """Whether ``token`` is to be replaced at ``now``."""
    return now >= token.refresh_at


def issued_token(volume: str, path: str, answer: dict[str, Any], requested_s: int, now: float) -> IssuedToken:
    """The token of a TokenRequest ``answer``; its lifetime as the API server granted it.

    Without an expiration in the answer, the requested lifetime counts from ``now``.
    """
    spec, status = answer.get("spec") or {}, answer.get("status") or {}
    seconds = int(spec.get("expirationSeconds") or requested_s)
    expires = parse_rfc3339(str(status.get("expirationTimestamp") or "")) or now + seconds
    return IssuedToken(volume, path, str(status.get("token", "")), seconds, expires)


def write_atomically(path: Path, text: str | bytes, mode: int = 0o600) -> None:
    """Replace ``path`` by ``text`` in one step: a reader sees the old file or the new one, never half.

    Also where the old file is read-only (a volume file of mode 0400).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
