"""A connection to one checkpoint service: what workers, peers and the durable copy use.

The connection is sealed and authenticates both ways when it opens (TLS 1.3 with the job's
certificate, :mod:`kelastic.agent.tls`; inside it :func:`kelastic.agent.auth.
client_handshake`, which checks that the service that answers is the one at the endpoint
meant) and is kept between requests; a broken one is replaced once per request. A service
that does not prove the key, or is another node than the endpoint names, is never sent a
request.
"""

from __future__ import annotations

import errno
import ipaddress
import random
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kelastic.agent import auth, tls
from kelastic.agent.checkpoint import wire
from kelastic.agent.checkpoint.errors import CheckpointError, SecretMismatch
from kelastic.agent.checkpoint.settings import ServiceLimits

__all__ = ["PEER_TIMEOUT", "ServiceClient", "open_channel", "parse_endpoint"]

#: Seconds a peer may take to answer one request (a frozen peer must not hold a save forever).
PEER_TIMEOUT = 30.0


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


_SECRET_MISMATCH = "the two do not hold the same job secret (--job-secret-file)"


#: Tries of a handshake the service cut off (it drops the oldest handshakes under a flood),
#: and the first pause between them (doubled each time, with jitter).
HANDSHAKE_TRIES = 6
HANDSHAKE_BACKOFF = 0.05


class _CutOff(Exception):
    """The handshake was cut off (closed or reset before it finished): worth another try."""


def open_channel(
    endpoint: str, key: bytes, timeout: float = PEER_TIMEOUT, source: str | None = None
) -> wire.Channel:
    """A sealed, authenticated connection to the service at ``endpoint`` (which must answer
    as that endpoint); CheckpointError saying why not. A handshake the service cut off (as
    it does to the oldest ones while it is flooded) is tried again, up to
    :data:`HANDSHAKE_TRIES` times with growing pauses. ``source``: the address to send
    from (a node sending in its own name sends from its own address, which the other end
    checks), where it is an IP address of this host; otherwise the kernel's choice."""
    pause = HANDSHAKE_BACKOFF
    for attempt in range(HANDSHAKE_TRIES):
        try:
            return _open_once(endpoint, key, timeout, source)
        except _CutOff as e:
            if attempt == HANDSHAKE_TRIES - 1:
                raise CheckpointError(
                    f"checkpoint service at {endpoint}: the handshake was cut off {HANDSHAKE_TRIES} times "
                    f"(the service is flooded with connections, or restarting): {e.__cause__}"
                ) from None
            time.sleep(pause * random.uniform(0.5, 1.5))
            pause *= 2
    raise AssertionError("unreachable")


def _connect(address: tuple[str, int], timeout: float, source: str | None) -> socket.socket:
    """A TCP connection to ``address`` from ``source`` when that is an IP address this host
    holds (several nodes on one host each hold a loopback address of their own, and the
    kernel would send from 127.0.0.1), else from the kernel's choice."""
    if source:
        try:
            ipaddress.ip_address(source)
            return socket.create_connection(address, timeout=timeout, source_address=(source, 0))
        except ValueError:
            pass  # a host name: the kernel's choice
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
    return socket.create_connection(address, timeout=timeout)


def _open_once(endpoint: str, key: bytes, timeout: float, source: str | None = None) -> wire.Channel:
    try:
        sock = _connect(parse_endpoint(endpoint), timeout, source)
    except OSError as e:
        raise CheckpointError(f"cannot reach the checkpoint service at {endpoint}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = tls.client_context(key).wrap_socket(sock)
        session = auth.client_handshake(sock, key, auth.Service.CHECKPOINT, endpoint)
    except (auth.HandshakeClosed, ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionResetError,
            BrokenPipeError) as e:  # fmt: skip
        sock.close()
        raise _CutOff() from e
    except auth.SecretMismatch as e:
        sock.close()
        raise SecretMismatch(f"checkpoint service at {endpoint}: {e}") from None
    except auth.AuthError as e:
        sock.close()
        raise CheckpointError(f"checkpoint service at {endpoint}: {e}") from None
    except ssl.SSLCertVerificationError:
        sock.close()
        raise SecretMismatch(
            f"checkpoint service at {endpoint}: its TLS certificate is not this job's: {_SECRET_MISMATCH}"
        ) from None
    except ssl.SSLError as e:
        sock.close()
        if "alert" in str(e):
            raise SecretMismatch(
                f"checkpoint service at {endpoint} refused this process: {_SECRET_MISMATCH}"
            ) from None
        raise CheckpointError(f"checkpoint service at {endpoint} refused this process: {e}") from None
    except OSError as e:
        sock.close()
        raise CheckpointError(f"checkpoint service at {endpoint}: handshake failed: {e}") from e
    return wire.Channel(sock, session, io_timeout=timeout, max_header=ServiceLimits().max_header)


class ServiceClient:
    """A connection to one checkpoint service; reconnects once after a broken connection.

    ``key`` is the job's key (:mod:`kelastic.agent.secret`). Not thread-safe: one per
    thread (the storage classes keep one per process, thread and endpoint).
    """

    def __init__(
        self, endpoint: str, key: bytes, timeout: float = PEER_TIMEOUT, source: str | None = None
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.source = source
        self._key = key
        self._channel: wire.Channel | None = None

    def _connect(self) -> wire.Channel:
        if self._channel is None:
            self._channel = open_channel(self.endpoint, self._key, self.timeout, self.source)
        return self._channel

    def close(self) -> None:
        if self._channel is not None:
            self._channel.sock.close()
            self._channel = None

    def call(
        self,
        header: dict[str, Any],
        payload: bytes = b"",
        *,
        timeout: float | None = None,
        into: memoryview | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        """Send one request (its payload sealed); the reply's header and payload (or the
        payload read ``into`` a buffer of its exact size). CheckpointError with the service's
        message on refusal."""
        for attempt in (0, 1):
            channel = self._connect()
            try:
                channel.send(header, payload)
                reply = channel.recv_header(timeout if timeout is not None else self.timeout)
                if reply is None:
                    raise wire.ProtocolError("the service closed the connection")
                if into is not None and reply.header.get("ok"):
                    channel.recv_payload_into(reply, into)
                    data = b""
                else:
                    data = channel.recv_payload(reply)
            except (OSError, wire.ProtocolError) as e:
                self.close()
                if attempt == 0 and not isinstance(e, TimeoutError):
                    continue
                raise CheckpointError(f"checkpoint service at {self.endpoint}: {e}") from e
            if not reply.header.get("ok"):
                raise CheckpointError(str(reply.header.get("error") or "refused"))
            return reply.header, data
        raise AssertionError("unreachable")

    def put_file(
        self,
        cid: int,
        name: str,
        path: Path,
        size: int,
        guard: Callable[[], bool] | None = None,
        sender: str | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Send a whole file as a replica (encrypted with the connection, like every byte).

        ``guard`` (see :meth:`wire.Channel.send_file`): when it says the file no longer held
        the checkpoint's bytes once they were read, the connection is closed before the
        message is complete (the peer keeps nothing) and CheckpointError says so; so when
        ``stop`` says the file is no longer wanted, asked before every piece.
        ``sender``: this node's endpoint as on the round's ring (the receiver takes replicas
        only from the nodes the ring assigns to it)."""
        channel = self._connect()
        header: dict[str, object] = {"op": "put", "id": cid, "name": name}
        if sender is not None:
            header["from"] = sender
        try:
            channel.send_header(header, size)
            with open(path, "rb") as f:
                whole = channel.send_file(f, 0, size, guard, stop)
            if not whole:
                self.close()
                raise CheckpointError(
                    f"{name} of checkpoint {cid} was dropped, or no longer wanted, while it was sent; not sent"
                )
            reply = channel.recv_header()
            if reply is None:
                raise wire.ProtocolError("the peer closed the connection")
            channel.discard(reply)
        except (OSError, wire.ProtocolError) as e:
            self.close()
            raise CheckpointError(f"sending {name} of checkpoint {cid} to {self.endpoint}: {e}") from e
        if not reply.header.get("ok"):
            raise CheckpointError(str(reply.header.get("error")))
