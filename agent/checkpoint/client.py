"""A connection to one checkpoint service: what workers, peers and the durable copy use.

The connection authenticates both ways when it opens (:func:`kelastic.agent.auth.
client_handshake`, with the job's key) and is kept between requests; a broken one is
replaced once per request. A service that does not prove the key is never sent a request.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from kelastic.agent import auth
from kelastic.agent.checkpoint import wire
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.settings import ServiceLimits

__all__ = ["PEER_TIMEOUT", "ServiceClient", "parse_endpoint"]

#: Seconds a peer may take to answer one request (a frozen peer must not hold a save forever).
PEER_TIMEOUT = 30.0


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class ServiceClient:
    """A connection to one checkpoint service; reconnects once after a broken connection.

    ``key`` is the job's key (:mod:`kelastic.agent.secret`). Not thread-safe: one per
    thread (the storage classes keep one per process, thread and endpoint).
    """

    def __init__(self, endpoint: str, key: bytes, timeout: float = PEER_TIMEOUT) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._key = key
        self._channel: wire.Channel | None = None

    def _connect(self) -> wire.Channel:
        if self._channel is None:
            try:
                sock = socket.create_connection(parse_endpoint(self.endpoint), timeout=self.timeout)
            except OSError as e:
                raise CheckpointError(f"cannot reach the checkpoint service at {self.endpoint}: {e}") from e
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                session = auth.client_handshake(sock, self._key, auth.Service.CHECKPOINT)
            except auth.AuthError as e:
                sock.close()
                raise CheckpointError(f"checkpoint service at {self.endpoint}: {e}") from None
            except OSError as e:
                sock.close()
                raise CheckpointError(f"checkpoint service at {self.endpoint}: handshake failed: {e}") from e
            self._channel = wire.Channel(
                sock, session, io_timeout=self.timeout, max_header=ServiceLimits().max_header
            )
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

    def put_file(self, cid: int, name: str, path: Path, size: int) -> None:
        """Send a whole file as a replica (zero-copy ``sendfile``, not sealed: see
        :mod:`~kelastic.agent.checkpoint.wire`)."""
        channel = self._connect()
        try:
            channel.send_header({"op": "put", "id": cid, "name": name}, size)
            with open(path, "rb") as f:
                sent = channel.sock.sendfile(f, 0, size)
            if sent != size:
                raise wire.ProtocolError(f"sent {sent} of {size} bytes of {name}")
            reply = channel.recv_header()
            if reply is None:
                raise wire.ProtocolError("the peer closed the connection")
            channel.discard(reply)
        except (OSError, wire.ProtocolError) as e:
            self.close()
            raise CheckpointError(f"sending {name} of checkpoint {cid} to {self.endpoint}: {e}") from e
        if not reply.header.get("ok"):
            raise CheckpointError(str(reply.header.get("error")))
