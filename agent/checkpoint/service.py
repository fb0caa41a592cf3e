"""The agent's checkpoint service: a TCP endpoint over one node's :class:`CheckpointKeeper`.

Every ``kelastic-agent`` runs one (``--checkpoint-*`` flags). Its clients are the node's own
workers (``MemoryWriter``/``MemoryReader``, which find it through
``$KELASTIC_CHECKPOINT_ENDPOINT``) and the other nodes' services and workers (replicas,
restores, commits). Operations (:mod:`~kelastic.agent.checkpoint.wire` framing):

=============  ===========================================================================
``begin``      reserve memory for a rank's part of the next save (waits for the previous
               replica); answers the newest checkpoint number seen, or why not
``open``       allocate the file a rank writes its part into (a path on this node's tmpfs)
``done``       the rank finished writing
``commit``     the checkpoint is complete: its metadata (payload), manifest and ring; starts
               the replication of this node's parts and, when due, the durable copy
``put``        a peer's part (payload), kept as a replica
``inventory``  what this node holds (:class:`~kelastic.agent.checkpoint.plan.Inventory`)
``metadata``   a checkpoint's metadata (payload)
``get``        a byte range of a held file (payload, sent with ``sendfile``)
``restored``   a rank restored checkpoint N from a source in S seconds
=============  ===========================================================================

Replication and durable copies run on one background thread, off the training path.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kelastic.agent.checkpoint import wire
from kelastic.agent.checkpoint.durable import DurableStore
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.keeper import CheckpointKeeper
from kelastic.agent.checkpoint.plan import successors
from kelastic.agent.checkpoint.settings import CheckpointSettings, format_bytes
from kelastic.agent.contract import ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_ENDPOINT, format_endpoint

__all__ = ["CheckpointService", "ServiceClient", "parse_endpoint"]

_log = logging.getLogger(__name__)

#: Seconds a peer may take to answer one request (a frozen peer must not hold a save forever).
PEER_TIMEOUT = 30.0


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class ServiceClient:
    """A connection to one checkpoint service; reconnects once after a broken connection.

    Not thread-safe: one per thread (the storage classes keep one per process and endpoint).
    """

    def __init__(self, endpoint: str, timeout: float = PEER_TIMEOUT) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            try:
                sock = socket.create_connection(parse_endpoint(self.endpoint), timeout=self.timeout)
            except OSError as e:
                raise CheckpointError(f"cannot reach the checkpoint service at {self.endpoint}: {e}") from e
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def call(
        self,
        header: dict[str, Any],
        payload: bytes = b"",
        *,
        timeout: float | None = None,
        into: memoryview | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        """Send one request; the reply's header and payload (or the payload read ``into`` a
        buffer of its exact size). CheckpointError with the service's message on refusal."""
        for attempt in (0, 1):
            sock = self._connect()
            sock.settimeout(timeout if timeout is not None else self.timeout)
            try:
                wire.send_message(sock, header, payload)
                got = wire.recv_header(sock)
                if got is None:
                    raise wire.ProtocolError("the service closed the connection")
                reply, length = got
                if into is not None and reply.get("ok"):
                    if length != len(into):
                        raise wire.ProtocolError(f"expected {len(into)} bytes, got {length}")
                    wire.recv_exact_into(sock, into)
                    data = b""
                else:
                    buf = bytearray(length)
                    wire.recv_exact_into(sock, memoryview(buf))
                    data = bytes(buf)
            except (OSError, wire.ProtocolError) as e:
                self.close()
                if attempt == 0 and not isinstance(e, TimeoutError):
                    continue
                raise CheckpointError(f"checkpoint service at {self.endpoint}: {e}") from e
            if not reply.get("ok"):
                raise CheckpointError(str(reply.get("error") or "refused"))
            return reply, data
        raise AssertionError("unreachable")

    def put_file(self, cid: int, name: str, path: Path, size: int) -> None:
        """Send a whole file as a replica (zero-copy ``sendfile``)."""
        sock = self._connect()
        sock.settimeout(self.timeout)
        try:
            wire.send_header(sock, {"op": "put", "id": cid, "name": name}, size)
            with open(path, "rb") as f:
                sent = sock.sendfile(f, 0, size)
            if sent != size:
                raise wire.ProtocolError(f"sent {sent} of {size} bytes of {name}")
            got = wire.recv_header(sock)
            if got is None:
                raise wire.ProtocolError("the peer closed the connection")
            reply, length = got
            wire.discard(sock, length)
        except (OSError, wire.ProtocolError) as e:
            self.close()
            raise CheckpointError(f"sending {name} of checkpoint {cid} to {self.endpoint}: {e}") from e
        if not reply.get("ok"):
            raise CheckpointError(str(reply.get("error")))


class CheckpointService:
    """Serves one node's checkpoint memory; see the module docstring for the operations.

    ``host`` is the address to listen on, ``advertise`` the one peers and workers use.
    ``on_restore(status)`` is called (on a service thread) the first time a restore is
    reported, ``on_commit(seconds)`` with each replication's duration; both optional.
    """

    def __init__(
        self,
        settings: CheckpointSettings,
        *,
        host: str = "0.0.0.0",
        advertise: str = "127.0.0.1",
        on_restore: Callable[[dict[str, Any]], None] | None = None,
        on_replicated: Callable[[int, float, int], None] | None = None,
    ) -> None:
        self._listener = socket.create_server((host, 0), backlog=128, reuse_port=False)
        self.endpoint = format_endpoint(advertise, self._listener.getsockname()[1])
        self.keeper = CheckpointKeeper(settings, self.endpoint)
        self.settings = settings
        self._on_restore = on_restore
        self._on_replicated = on_replicated
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> CheckpointService:
        for target, name in ((self._accept, "accept"), (self._background, "replicate")):
            t = threading.Thread(target=target, name=f"kelastic-checkpoint-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        _log.info("%s; service at %s", self.settings.describe(), self.endpoint)
        return self

    def stop(self, *, remove: bool = True) -> None:
        """Stop serving; with ``remove`` the node's checkpoint memory is freed."""
        self._stopped.set()
        self._jobs.put(None)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self._threads:
            t.join(timeout=5)
        self.keeper.close(remove=remove)

    def worker_env(self) -> dict[str, str]:
        """The variables that let a worker's ``MemoryWriter``/``MemoryReader`` find this service."""
        return {ENV_CHECKPOINT_ENDPOINT: self.endpoint, ENV_CHECKPOINT_DIR: str(self.settings.root)}

    # --- serving -----------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="kelastic-checkpoint-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stopped.is_set():
                got = wire.recv_header(conn)
                if got is None:
                    return
                header, length = got
                try:
                    self._dispatch(conn, header, length)
                except CheckpointError as e:
                    wire.send_message(conn, {"ok": False, "error": str(e)})
                except (KeyError, TypeError, ValueError) as e:
                    wire.send_message(
                        conn, {"ok": False, "error": f"bad request {header.get('op')!r}: {e!r}"}
                    )
        except (OSError, wire.ProtocolError) as e:
            if not self._stopped.is_set():
                _log.debug("checkpoint connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _dispatch(self, conn: socket.socket, h: dict[str, Any], length: int) -> None:
        op = h.get("op")
        k = self.keeper
        if op == "put":
            self._receive_replica(conn, int(h["id"]), str(h["name"]), length)
            return
        payload = b""
        if length:
            buf = bytearray(length)
            wire.recv_exact_into(conn, memoryview(buf))
            payload = bytes(buf)
        if op == "begin":
            newest, refusal = k.begin(
                int(h["rank"]), int(h["bytes"]), float(h.get("timeout", 300.0)), int(h.get("pid", 0))
            )
            if refusal is not None:
                _log.error("checkpoint refused for rank %s: %s", h["rank"], refusal.reason)
            reply: dict[str, Any] = {"ok": True, "newest": newest, "node": k.settings.node}
            if refusal is not None:
                reply["refused"] = refusal.reason
            wire.send_message(conn, reply)
        elif op == "open":
            path = k.open(int(h["id"]), str(h["name"]), int(h["size"]), int(h["rank"]))
            wire.send_message(conn, {"ok": True, "path": str(path)})
        elif op == "done":
            k.done(int(h["rank"]))
            wire.send_message(conn, {"ok": True})
        elif op == "commit":
            self._commit(h, payload)
            wire.send_message(conn, {"ok": True})
        elif op == "inventory":
            wire.send_message(conn, {"ok": True, "inventory": k.inventory().to_json()})
        elif op == "metadata":
            wire.send_message(conn, {"ok": True}, k.metadata(int(h["id"])))
        elif op == "get":
            self._send_range(conn, int(h["id"]), str(h["name"]), int(h["offset"]), int(h["length"]))
        elif op == "restored":
            status_step = h.get("step")
            first = k.restored(
                int(h["id"]),
                str(h["source"]),
                float(h["seconds"]),
                None if status_step is None else int(status_step),
            )
            wire.send_message(conn, {"ok": True})
            if first and self._on_restore is not None:
                self._on_restore(k.status())
        else:
            raise CheckpointError(f"unknown operation {op!r}")

    def _receive_replica(self, conn: socket.socket, cid: int, name: str, length: int) -> None:
        try:
            part = self.keeper.replica_target(cid, name, length)
        except CheckpointError as e:
            wire.discard(conn, length)
            wire.send_message(conn, {"ok": False, "error": str(e)})
            return
        try:
            with open(part, "r+b") as f:
                wire.recv_to_file(conn, f, length)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        self.keeper.replica_done(cid, name, part, length)
        wire.send_message(conn, {"ok": True})

    def _send_range(self, conn: socket.socket, cid: int, name: str, offset: int, length: int) -> None:
        path = self.keeper.readable(cid, name)
        with open(path, "rb") as f:
            wire.send_header(conn, {"ok": True}, length)
            sent = conn.sendfile(f, offset, length)
        if sent != length:
            raise wire.ProtocolError(f"sent {sent} of {length} bytes of {name}")

    def _commit(self, h: dict[str, Any], metadata: bytes) -> None:
        cid = int(h["id"])
        ring = [str(e) for e in h["ring"]]
        required = {str(n): int(s) for n, s in dict(h["required"]).items()}
        step = h.get("step")
        self.keeper.commit(cid, metadata, required, ring, None if step is None else int(step))
        targets = successors(ring, self.endpoint, self.settings.replicas)
        files = self.keeper.own_files(cid)
        if targets and files:
            self.keeper.outgoing(+1)
            self._jobs.put(lambda: self._replicate(cid, files, targets))
        if h.get("coordinator") and self.keeper.persist_due(cid):
            self.keeper.pin(cid)
            self._jobs.put(lambda: self._persist(cid, ring))

    # --- background work ---------------------------------------------------------------------
    def _background(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                _log.exception("checkpoint background work failed")

    def _replicate(self, cid: int, files: list[tuple[str, int]], targets: list[str]) -> None:
        began = time.monotonic()
        total = 0
        try:
            for target in targets:
                client = ServiceClient(target)
                try:
                    for name, size in files:
                        client.put_file(cid, name, self.keeper.path_of(cid, name), size)
                        total += size
                except CheckpointError as e:
                    _log.warning(
                        "checkpoint %d: no replica of this node's part on %s (%s); the checkpoint is "
                        "complete but would not survive the loss of this node",
                        cid,
                        target,
                        e,
                    )
                finally:
                    client.close()
        finally:
            self.keeper.outgoing(-1)
        seconds = time.monotonic() - began
        _log.debug("checkpoint %d: %s replicated to %s in %.3f s", cid, format_bytes(total), targets, seconds)
        if self._on_replicated is not None:
            self._on_replicated(cid, seconds, total)

    def _persist(self, cid: int, ring: list[str]) -> None:
        from kelastic.agent.checkpoint.persist import write_durable

        try:
            assert self.settings.persist_dir is not None
            began = time.monotonic()
            path = write_durable(
                self.keeper, cid, ring, DurableStore(self.settings.persist_dir), self.settings.persist_keep
            )
            _log.info("checkpoint %d persisted to %s in %.1f s", cid, path, time.monotonic() - began)
        except Exception as e:
            _log.error(
                "checkpoint %d: the durable copy in %s failed: %s; the memory checkpoint stands",
                cid,
                self.settings.persist_dir,
                e,
            )
        finally:
            self.keeper.unpin(cid)
