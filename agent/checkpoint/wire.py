"""The checkpoint service's framing: authenticated messages of a JSON header and a payload.

A connection is TLS 1.3 between two holders of the job's secret (:mod:`kelastic.agent.tls`),
so every byte on it is encrypted and authenticated; it starts with :mod:`kelastic.agent.
auth`'s handshake (service ``CHECKPOINT``, which binds it to the node the client meant);
every message after it is::

    prefix   flags (1 byte) | 3 zero bytes | header length (4) | payload length (8), big-endian
    tag      HMAC(session key, seq | prefix | header)                        32 bytes
    header   UTF-8 JSON object                                               header length
    payload  raw bytes                                                       payload length
    [ptag]   HMAC(session key, seq + 1 | payload), only when flags has SEALED

The receiver checks the tag before it parses the header (a message that fails is never
read further: the connection is closed) and a sealed payload's tag before it hands the
payload on. Requests carry ``{"op": …}``; replies ``{"ok": true, …}`` or ``{"ok": false,
"error": "…"}``.

**What is sealed.** Everything, by TLS: headers, payloads and the bulk bytes of parts
(``put``, the ``get`` reply). On top of TLS every header and the payloads that steer the
job (a commit's metadata, the ``metadata`` reply) carry the MACs above, under the keys of
the handshake that named the server, with sequence numbers.

A payload is read as it arrives, in chunks: a peer that announces a large payload and
sends nothing makes the receiver allocate nothing. A large header is counted against the
receiver's budget (the node's checkpoint memory) before it is read. Every message has a
pace besides the timeout of each read: its header (counted when over 64 KiB) must arrive
within the I/O timeout of its first byte, and its payload, after a grace of the I/O
timeout, at :data:`MIN_RATE` at least, so a peer that trickles a byte now and then cannot
hold a connection.
"""

from __future__ import annotations

import json
import mmap
import socket
import struct
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

from kelastic.agent.auth import TAG_SIZE, AuthError, Session

__all__ = ["MIN_RATE", "SEALED", "Budget", "Channel", "IdleTimeout", "Message", "OverBudget", "ProtocolError"]

PREFIX = struct.Struct(">BxxxIQ")
#: The payload carries its own tag.
SEALED = 0x01
_CHUNK = 4 * 2**20
#: Below this, a message goes out in one ``sendall`` (one packet with TCP_NODELAY).
_SMALL = 64 * 2**10
#: Bytes a second a payload must arrive at, at least, after a grace of the I/O timeout.
MIN_RATE = 2**20


class ProtocolError(ConnectionError):
    """The peer closed the connection or sent something that is not a message."""


class OverBudget(ProtocolError):
    """A header the receiver's memory budget cannot take (the connection is closed)."""


class Budget(Protocol):
    """Where a header's bytes are counted while it is read (the node's checkpoint memory)."""

    def reserve(self, nbytes: int, what: str) -> None:
        """Count ``nbytes``; raise when they would not fit."""
        ...

    def release(self, nbytes: int) -> None: ...


class IdleTimeout(TimeoutError):
    """No message began within the idle timeout (not an error: the connection rests)."""


@dataclass(frozen=True)
class Message:
    """A received header; its payload (``length`` bytes, ``sealed`` or not) is still on the
    connection for :meth:`Channel.recv_payload` and friends."""

    header: dict[str, Any]
    length: int
    sealed: bool


class Channel:
    """One authenticated connection's messages (after the handshake).

    ``io_timeout`` bounds every read and write inside a message: a peer that sends half a
    message and waits is cut off after it (TimeoutError). ``max_header`` caps a header.
    Not thread-safe: one request and its reply at a time.
    """

    def __init__(
        self,
        sock: socket.socket,
        session: Session,
        *,
        io_timeout: float,
        max_header: int,
        budget: Budget | None = None,
    ) -> None:
        self.sock = sock
        self._session = session
        self._io_timeout = io_timeout
        self._max_header = max_header
        self._budget = budget
        self._timeout: float | None = -1.0
        #: the pace a message being read must keep: (began, bytes a second: 0 for "all
        #: within the I/O timeout"), and the bytes of it that arrived
        self._pace: tuple[float, float] | None = None
        self._arrived = 0

    def _wait(self, seconds: float) -> None:
        """Set the socket's timeout (only when it changes: most messages keep one)."""
        if seconds != self._timeout:
            self.sock.settimeout(seconds)
            self._timeout = seconds

    # --- sending -------------------------------------------------------------------------------
    def send(self, header: dict[str, Any], payload: bytes | memoryview = b"", *, sealed: bool = True) -> None:
        """Send a header and its whole payload (sealed unless told otherwise)."""
        seal = sealed and len(payload) > 0
        head = self.head(header, len(payload), SEALED if seal else 0)
        tail = self._session.seal(payload) if seal else b""
        self._wait(self._io_timeout)
        if len(payload) < _SMALL:
            self.sock.sendall(b"".join((head, payload, tail)))
            return
        self.sock.sendall(head)
        self.sock.sendall(payload)
        if tail:
            self.sock.sendall(tail)

    def send_file(
        self,
        f: BinaryIO,
        offset: int,
        length: int,
        guard: Callable[[], bool] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Send ``length`` bytes of ``f`` from ``offset`` (after :meth:`send_header`), from a
        read-only mapping of the file, in pieces (``sendfile`` cannot encrypt).

        ``guard`` (for a file whose owner may reuse it meanwhile): its last piece is copied,
        then ``guard()`` is asked whether the file still held what was meant when every byte
        had been read; False sends nothing more and returns False (the message is left
        short: the caller closes the connection, and the receiver drops what it got).
        ``stop``, asked before every piece: True leaves the message short the same way (the
        bytes are no longer wanted)."""
        if not length:
            return guard is None or guard()
        self._wait(self._io_timeout)
        end = offset + length
        last = end if guard is None else max(offset, end - _CHUNK)
        with mmap.mmap(f.fileno(), end, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for at in range(offset, last, _CHUNK):
                    if stop is not None and stop():
                        return False
                    self.sock.sendall(view[at : min(at + _CHUNK, last)])
                tail = bytes(view[last:end])
            except BaseException as exc:
                # A send the peer cut off leaves slices of the mapping in the locals of its
                # frames (ssl's ``sendall`` holds one): the mapping could not close, and a
                # BufferError would replace the connection's error.
                traceback.clear_frames(exc.__traceback__)
                raise
            finally:
                view.release()
        if guard is not None and not guard():
            return False
        self.sock.sendall(tail)
        return True

    def send_header(self, header: dict[str, Any], length: int) -> None:
        """Send a header announcing ``length`` unsealed bytes; the caller sends them next."""
        self._wait(self._io_timeout)
        self.sock.sendall(self.head(header, length, 0))

    def head(self, header: dict[str, Any], length: int, flags: int) -> bytes:
        """The bytes of a message's prefix, tag and header (its tag takes the next sequence
        number): what :meth:`send` and :meth:`send_header` send first."""
        body = json.dumps(header, separators=(",", ":")).encode()
        prefix = PREFIX.pack(flags, len(body), length)
        return prefix + self._session.seal(prefix, body) + body

    # --- receiving -----------------------------------------------------------------------------
    def recv_header(self, idle_timeout: float | None = None) -> Message | None:
        """The next message's header, checked; None when the peer closed between messages.

        Waits up to ``idle_timeout`` (default: the I/O timeout) for the message to begin
        (IdleTimeout), then ``io_timeout`` for each piece of it (TimeoutError). ProtocolError
        for anything that is not an authentic message (the caller closes).
        """
        # Waiting in steps of the I/O timeout keeps one timeout on the socket for every message.
        step = self._io_timeout if idle_timeout is None else min(self._io_timeout, idle_timeout)
        self._wait(step)
        prefix = bytearray(PREFIX.size)
        waited = 0.0
        while True:
            try:
                first = self.sock.recv_into(prefix)
                break
            except TimeoutError:
                waited += step
                if idle_timeout is None or waited >= idle_timeout:
                    raise IdleTimeout(f"no message for {waited:g} s") from None
        if first == 0:
            return None
        self._wait(self._io_timeout)
        self._keep_pace(0.0)
        try:
            if first < len(prefix):
                self.recv_into(memoryview(prefix)[first:])
            flags, header_len, length = PREFIX.unpack(prefix)
            if header_len > self._max_header or flags & ~SEALED:
                raise ProtocolError(
                    f"a header of {header_len} bytes (flags {flags:#x}): not a checkpoint peer"
                )
            return self._read_header(prefix, header_len, length, bool(flags & SEALED))
        finally:
            self._pace = None

    def _read_header(self, prefix: bytearray, header_len: int, length: int, sealed: bool) -> Message:
        # A large header is counted before it is allocated; the small ones every request has
        # are not (at most one per connection, a bounded number of connections).
        counted = TAG_SIZE + header_len if self._budget is not None and header_len > _SMALL else 0
        if counted:
            assert self._budget is not None
            try:
                self._budget.reserve(counted, "a request's header")
            except Exception as e:
                raise OverBudget(str(e)) from None
        try:
            rest = bytearray(TAG_SIZE + header_len)
            self.recv_into(memoryview(rest))
            return self._check_header(prefix, rest, length, sealed)
        finally:
            if counted:
                assert self._budget is not None
                self._budget.release(counted)

    def _check_header(self, prefix: bytearray, rest: bytearray, length: int, sealed: bool) -> Message:
        tag, body = bytes(rest[:TAG_SIZE]), memoryview(rest)[TAG_SIZE:]
        try:
            self._session.open(tag, prefix, body)
        except AuthError as e:
            raise ProtocolError(str(e)) from e
        try:
            header = json.loads(body.tobytes())
        except ValueError as e:
            raise ProtocolError(f"unreadable header: {e}") from e
        if not isinstance(header, dict):
            raise ProtocolError("a header must be a JSON object")
        return Message(header, length, sealed)

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` from the connection (no MAC: framing and bulk bytes)."""
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:], min(len(view) - got, _CHUNK))
            if n == 0:
                raise ProtocolError("connection closed in the middle of a message")
            got += n
            if self._pace is not None and got < len(view):
                self._check_pace(n)

    def _keep_pace(self, rate: float) -> None:
        self._pace = (time.monotonic(), rate)
        self._arrived = 0

    def _check_pace(self, n: int) -> None:
        """TimeoutError when the message being read fell behind its pace (a trickle)."""
        assert self._pace is not None
        self._arrived += n
        began, rate = self._pace
        late = time.monotonic() - began - self._io_timeout
        if late > 0 and (rate == 0 or self._arrived < late * rate):
            raise TimeoutError(
                f"the message arrives too slowly ({self._arrived} bytes in {late + self._io_timeout:.0f} s): "
                "cut off"
            )

    def _check_tail(self, h: Any) -> None:
        tag = bytearray(TAG_SIZE)
        self.recv_into(memoryview(tag))
        try:
            Session.verify(h, bytes(tag))
        except AuthError as e:
            raise ProtocolError(str(e)) from e

    def recv_payload(self, msg: Message) -> bytes:
        """The whole payload of ``msg``, read as it arrives (never allocated ahead), its tag
        checked when sealed."""
        out = bytearray()
        self._stream(msg, out.extend, chunk=2**20)
        return bytes(out)

    def recv_payload_into(self, msg: Message, view: memoryview) -> None:
        """The payload of ``msg`` straight into ``view`` (of its exact size)."""
        if len(view) != msg.length:
            raise ProtocolError(f"expected {len(view)} bytes, got {msg.length}")
        h = self._session.incoming() if msg.sealed else None
        self._keep_pace(MIN_RATE)
        try:
            self.recv_into(view)
            if h is not None:
                h.update(view)
                self._check_tail(h)
        finally:
            self._pace = None

    def recv_to_file(self, msg: Message, f: BinaryIO) -> None:
        """Stream the payload of ``msg`` into ``f`` at its current position."""
        self._stream(msg, f.write)

    def discard(self, msg: Message) -> None:
        """Read and drop the payload of ``msg`` (a refused upload), keeping the stream in step."""
        self._stream(msg, None)

    def _stream(
        self, msg: Message, write: Callable[[memoryview], object] | None, chunk: int = _CHUNK
    ) -> None:
        self._keep_pace(MIN_RATE)
        try:
            self._stream_within(msg, write, chunk)
        finally:
            self._pace = None

    def _stream_within(self, msg: Message, write: Callable[[memoryview], object] | None, chunk: int) -> None:
        h = self._session.incoming() if msg.sealed else None
        buf = bytearray(min(msg.length, chunk) or 1)
        view = memoryview(buf)
        left = msg.length
        while left:
            # whole pieces (TLS hands out records of 16 KiB): one write per piece
            n = min(left, len(buf))
            self.recv_into(view[:n])
            if h is not None:
                h.update(view[:n])
            if write is not None:
                write(view[:n])
            left -= n
        if h is not None:
            self._check_tail(h)
