"""The checkpoint service's framing: a JSON header and a raw payload on a TCP stream.

A message is ``<header length: 8 bytes big-endian><payload length: 8 bytes big-endian>``,
the header (UTF-8 JSON object), then the payload bytes. Requests carry ``{"op": …}``;
replies ``{"ok": true, …}`` or ``{"ok": false, "error": "…"}``. The payload is streamed:
a receiver reads it straight into a file or a buffer, so a part of hundreds of MiB is
never held twice.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any, BinaryIO

__all__ = ["ProtocolError", "recv_exact_into", "recv_header", "recv_to_file", "send_header", "send_message"]

_PREFIX = struct.Struct(">QQ")
#: Headers are small; anything larger is a stray connection, not a peer.
_MAX_HEADER = 16 * 2**20
_CHUNK = 4 * 2**20


class ProtocolError(ConnectionError):
    """The peer closed the connection or sent something that is not a message."""


def send_header(sock: socket.socket, header: dict[str, Any], payload_len: int = 0) -> None:
    """Send a header announcing ``payload_len`` bytes; the caller sends them next."""
    body = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_PREFIX.pack(len(body), payload_len) + body)


def send_message(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Send a header and its whole payload."""
    send_header(sock, header, len(payload))
    if payload:
        sock.sendall(payload)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; ProtocolError if it closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, _CHUNK))
        if n == 0:
            raise ProtocolError("connection closed in the middle of a message")
        got += n


def recv_header(sock: socket.socket) -> tuple[dict[str, Any], int] | None:
    """The next header and its payload length, or None when the peer closed cleanly."""
    prefix = bytearray(_PREFIX.size)
    first = sock.recv_into(prefix)
    if first == 0:
        return None
    if first < len(prefix):
        recv_exact_into(sock, memoryview(prefix)[first:])
    header_len, payload_len = _PREFIX.unpack(prefix)
    if header_len > _MAX_HEADER:
        raise ProtocolError(f"header of {header_len} bytes: not a kelastic checkpoint peer")
    body = bytearray(header_len)
    recv_exact_into(sock, memoryview(body))
    try:
        header = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"unreadable header: {e}") from e
    if not isinstance(header, dict):
        raise ProtocolError("a header must be a JSON object")
    return header, payload_len


def recv_to_file(sock: socket.socket, f: BinaryIO, length: int) -> None:
    """Stream ``length`` payload bytes into ``f`` at its current position."""
    buf = bytearray(min(length, _CHUNK) or 1)
    view = memoryview(buf)
    left = length
    while left:
        n = sock.recv_into(view, min(left, len(buf)))
        if n == 0:
            raise ProtocolError("connection closed in the middle of a payload")
        f.write(view[:n])
        left -= n


def discard(sock: socket.socket, length: int) -> None:
    """Read and drop ``length`` payload bytes (a refused upload)."""
    with open(os.devnull, "wb") as sink:
        recv_to_file(sock, sink, length)
