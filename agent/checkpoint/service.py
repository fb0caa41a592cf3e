"""The agent's checkpoint service: a TCP endpoint over one node's :class:`CheckpointKeeper`.

Every ``kelastic-agent`` runs one (``--checkpoint-*`` flags). Its clients are the node's own
workers (``MemoryWriter``/``MemoryReader``, which find it through
``$KELASTIC_CHECKPOINT_ENDPOINT``) and the other nodes' services and workers (replicas,
restores, commits). Every connection is sealed: TLS 1.3 whose both ends prove the job's
secret (:mod:`kelastic.agent.tls`), so every byte after its handshake, parts included, is
encrypted and authenticated; inside it :mod:`kelastic.agent.auth`'s handshake, in which
this service names itself by its endpoint (a client that reached another node than it
meant, through a relay, refuses), then a MAC on every message (:mod:`.wire`). A
connection that does not prove the secret is closed before anything it sent is parsed,
and counted. Operations
(:mod:`.requests` checks every field):

=============  ===========================================================================
``begin``      reserve memory for a rank's part of the next save (waits for the previous
               replica, up to its timeout; 0: refuses at once, ``busy``); answers the newest
               checkpoint number seen, or why not
``open``       allocate the file a rank writes its part into (a path on this node's tmpfs)
``done``       the rank finished writing
``commit``     the checkpoint is complete: its metadata (sealed payload; a DCP metadata whose
               items lie in the manifest's files, read without running code) and manifest; starts
               the replication of this node's parts to its successors on the *ring of the
               current rendezvous round* (:meth:`CheckpointService.set_ring`, never a list
               the request names), their copy to the hot standbys the round's
               :class:`~kelastic.agent.checkpoint.plan.ReplicaPlan` assigns them
               (:mod:`.standbyfeed`), and, on the ring's first node when due, the durable copy
``put``        a peer's part (payload), kept as a replica (never replacing a file held)
``inventory``  what this node holds (:class:`~kelastic.agent.checkpoint.plan.Inventory`); with
               ``wait`` (a worker's restore), after the parts :mod:`.prefetch` is pulling;
               ``pull`` false (a worker that rolls forward from a peer's live state): the
               pulls under way stop, and later rounds pull nothing ahead until ``pull`` true
``metadata``   a checkpoint's metadata (sealed payload)
``get``        a byte range of a held file (payload)
``restored``   a rank of this node restored checkpoint N from a source in S seconds (recorded;
               drops nothing)
=============  ===========================================================================

Bad input gets an error reply, or a closed connection when the stream cannot be trusted
any more; the service logs it in one line and goes on serving. Connections are bounded
(:class:`~kelastic.agent.checkpoint.settings.ServiceLimits`, :mod:`.admission`).

Replication and durable copies run on one background thread, off the training path. After
every rendezvous (``set_ring``) the parts of the checkpoint the group will restore that this
node lacks are pulled into its memory beside the workers' start (:mod:`.prefetch`), unless
its workers said they roll forward instead (``pull`` false): then the bytes a roll-forward
copies between the workers would share the CPU with a pull they never read.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kelastic.agent import auth, tls
from kelastic.agent.checkpoint import codec, wire
from kelastic.agent.checkpoint import requests as rq
from kelastic.agent.checkpoint.admission import Admission
from kelastic.agent.checkpoint.client import ServiceClient, open_channel, parse_endpoint
from kelastic.agent.checkpoint.durable import DurableStore
from kelastic.agent.checkpoint.errors import CheckpointError, SecretMismatch
from kelastic.agent.checkpoint.folder import FolderClaim
from kelastic.agent.checkpoint.keeper import CheckpointKeeper
from kelastic.agent.checkpoint.plan import ReplicaPlan, StandbyHolder, replica_refusal
from kelastic.agent.checkpoint.prefetch import PREFETCH_TIMEOUT, Prefetch
from kelastic.agent.checkpoint.secretcheck import judge_secret
from kelastic.agent.checkpoint.settings import CheckpointSettings, ServiceLimits, format_bytes
from kelastic.agent.checkpoint.standbyfeed import STANDBY_TIMEOUT, StandbyFeed
from kelastic.agent.contract import ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_ENDPOINT, format_endpoint
from kelastic.agent.secret import JobSecret, ephemeral_secret

__all__ = ["SERVICE", "CheckpointService"]

_log = logging.getLogger(__name__)

#: This service's name in :data:`kelastic.agent.auth.REFUSALS` and ``/metrics``.
SERVICE = "checkpoint"


class _Close(Exception):
    """End this connection (after a refusal whose payload is not worth reading)."""


def _shut_down(s: socket.socket) -> None:
    """Shut ``s`` down from another thread: the TCP connection itself (an SSLSocket's own
    ``shutdown`` would also drop its TLS state under the thread that reads it)."""
    try:
        socket.socket.shutdown(s, socket.SHUT_RDWR)
    except OSError:
        pass


def _shut(socks: Sequence[socket.socket]) -> None:
    for s in socks:
        auth.REFUSALS.count(SERVICE, auth.Reason.OVER_CAPACITY)
        _shut_down(s)


class CheckpointService:
    """Serves one node's checkpoint memory; see the module docstring for the operations.

    ``secret`` is the job's key (None: a key of the service's own, in a 0600 file it removes
    when it stops; enough where no other node talks to it); ``host`` is the address to listen
    on, ``advertise`` the one peers and workers use. ``on_restore(status)`` is called (on a service thread) the first
    time a restore is reported, ``on_replicated(id, seconds, bytes)`` after each
    replication; both optional. ``standbys()`` names the job's hot standbys (what they
    announced, :mod:`.standbys`): with it, this node's parts also go to those the round's
    :class:`~kelastic.agent.checkpoint.plan.ReplicaPlan` assigns them (:mod:`.standbyfeed`).
    """

    def __init__(
        self,
        settings: CheckpointSettings,
        secret: JobSecret | None = None,
        *,
        host: str = "0.0.0.0",
        advertise: str = "127.0.0.1",
        on_restore: Callable[[dict[str, Any]], None] | None = None,
        on_replicated: Callable[[int, float, int], None] | None = None,
        limits: ServiceLimits = ServiceLimits(),
        standbys: Callable[[], Sequence[StandbyHolder]] | None = None,
        claim: FolderClaim | None = None,
    ) -> None:
        self._listener = socket.create_server((host, 0), backlog=128, reuse_port=False)
        self.endpoint = format_endpoint(advertise, self._listener.getsockname()[1])
        #: Peers take a replica in this node's name only from its advertised address.
        self._source = advertise
        self.keeper = CheckpointKeeper(settings, self.endpoint)
        self._claim = claim
        #: Set (once) when the ring's handshakes show this node holds another secret than
        #: the job's (:mod:`.secretcheck`): the agent stops with it.
        self.secret_mismatch: str | None = None
        self.settings = settings
        self.limits = limits
        self._own_secret = secret is None
        self._secret = ephemeral_secret() if secret is None else secret
        self._tls = tls.server_context(self._secret.key)
        self._on_restore = on_restore
        self._on_replicated = on_replicated
        self._ring: tuple[str, ...] = ()
        #: Whether a new round pulls ahead the parts the group's restore will read (the
        #: node's workers' last word, ``inventory``'s ``pull``).
        self._pull_ahead = True
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self.admission = Admission(limits.connections, limits.handshakes)
        self._prefetch = Prefetch(
            self.endpoint,
            self.keeper,
            lambda e: ServiceClient(e, self._secret.key, PREFETCH_TIMEOUT, self._source),
        )
        self._feed = (
            None
            if standbys is None
            else StandbyFeed(
                self.endpoint,
                self.keeper,
                lambda e: ServiceClient(e, self._secret.key, STANDBY_TIMEOUT, self._source),
                standbys,
                settings.replicas,
            )
        )

    def start(self) -> CheckpointService:
        for target, name in ((self._accept, "accept"), (self._background, "replicate")):
            t = threading.Thread(target=target, name=f"kelastic-checkpoint-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        if self._feed is not None:
            self._feed.start()
        # One short line; the paths (the tmpfs folder, the secret's file) are details.
        _log.info("%s; service at %s", self.settings.summary(), self.endpoint)
        _log.debug("%s; authenticated with %s", self.settings.describe(), self._secret.describe())
        return self

    def stop(self, *, remove: bool = True) -> None:
        """Stop serving; with ``remove`` the node's checkpoint memory is freed."""
        self._stopped.set()
        self._prefetch.stop()
        self._jobs.put(None)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()
        for c in self.admission.sockets():
            _shut_down(c)
        for t in self._threads:
            t.join(timeout=5)
        if self._feed is not None:
            self._feed.stop()
        self.keeper.close(remove=remove)
        if self._claim is not None:
            self._claim.release()
        if self._own_secret:
            self._secret.discard()

    def worker_env(self) -> dict[str, str]:
        """What a worker's ``MemoryWriter``/``MemoryReader`` needs to find this service and
        prove the job's secret to it (the secret's path, never the key)."""
        return {
            ENV_CHECKPOINT_ENDPOINT: self.endpoint,
            ENV_CHECKPOINT_DIR: str(self.settings.root),
            **self._secret.worker_env(),
        }

    def client(self, endpoint: str) -> ServiceClient:
        """A connection to ``endpoint`` (a peer's service) with this node's key."""
        return ServiceClient(endpoint, self._secret.key, source=self._source)

    # --- the ring ------------------------------------------------------------------------------
    def set_ring(self, ring: Sequence[str]) -> None:
        """The group's nodes of the current rendezvous round, in group rank order: where
        this node's parts are replicated and which node writes the durable copy. The agent
        calls it after every rendezvous, once the old workers are stopped or parked (the saves
        they began are void then: :meth:`CheckpointKeeper.new_group`); a commit never names it."""
        checked: list[str] = []
        for endpoint in ring:
            parse_endpoint(endpoint)  # ValueError for anything that is not HOST:PORT
            if endpoint not in checked:
                checked.append(endpoint)
        self._ring = tuple(checked)
        # The standbys' copies in flight stop: the CPU is the restore's. The ring replica goes on:
        # a node that leaves the group (a straggler stepping aside, a scale-down) leaves its part
        # of the newest checkpoint only there.
        if self._feed is not None:
            self._feed.new_round()
        _log.debug("checkpoint ring of this round: %s", checked)
        self.keeper.new_group()  # the old workers are stopped or parked: their saves are void
        # The group restores next (a new group, or the same one after a worker failed).
        if self._pull_ahead:
            self._prefetch.start(self._ring)

    @property
    def ring(self) -> tuple[str, ...]:
        return self._ring

    def _preferred(self, conn: socket.socket) -> bool:
        """Whether ``conn`` comes from this node's own address or a ring node's (its ranks
        and ring neighbours go first when connections are short)."""
        try:
            source = str(conn.getpeername()[0])
        except OSError:
            return False
        hosts = {parse_endpoint(e)[0] for e in (self.endpoint, *self._ring)}
        return source in hosts

    # --- serving -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                raw, peer = self._listener.accept()
                conn = self._tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            except OSError:
                if self._stopped.is_set():
                    return
                continue
            _shut(self.admission.arrive(conn, str(peer[0])))
            threading.Thread(
                target=self._serve, args=(conn,), name="kelastic-checkpoint-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        reason: auth.Reason | None = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.limits.handshake_timeout)
            try:
                assert isinstance(conn, ssl.SSLSocket)
                conn.do_handshake()
                session = auth.server_handshake(
                    conn, self._secret.key, auth.Service.CHECKPOINT, self.endpoint
                )
            except (auth.AuthError, ssl.SSLError):
                reason = auth.Reason.UNAUTHENTICATED
                return
            admitted, evicted = self.admission.authenticated(
                conn, self.limits.io_timeout, preferred=self._preferred(conn)
            )
            _shut(evicted)
            if not admitted:
                reason = auth.Reason.OVER_CAPACITY
                return
            channel = wire.Channel(
                conn,
                session,
                io_timeout=self.limits.io_timeout,
                max_header=self.limits.max_header,
                budget=self.keeper,
            )
            while not self._stopped.is_set():
                msg = channel.recv_header(self.limits.idle_timeout)
                if msg is None or not self.admission.busy(conn):
                    return
                try:
                    self._handle(channel, msg)
                finally:
                    self.admission.idle(conn)
        except (wire.IdleTimeout, _Close):
            pass
        except TimeoutError:
            reason = auth.Reason.TIMEOUT
        except wire.OverBudget:
            reason = auth.Reason.OVER_CAPACITY
        except wire.ProtocolError:
            reason = auth.Reason.BAD_FRAME
        except OSError:
            pass  # reset, shut down by stop() or for a newer connection
        except Exception as e:  # a bug must cost this connection, never the service
            _log.warning("checkpoint connection dropped after an unexpected %s: %s", type(e).__name__, e)
        finally:
            held = self.admission.leave(conn)
            # counted before the close: whoever sees the connection closed sees it counted
            if held and reason is not None and not self._stopped.is_set():
                auth.REFUSALS.count(SERVICE, reason)
                _log.debug("checkpoint connection refused: %s", reason.value)
            conn.close()

    def _handle(self, channel: wire.Channel, msg: wire.Message) -> None:
        try:
            req = rq.parse(
                msg.header,
                msg.length,
                msg.sealed,
                max_metadata=self.limits.max_metadata,
                max_part=self.keeper.limit,
            )
        except rq.BadRequest as e:
            auth.REFUSALS.count(SERVICE, auth.Reason.BAD_REQUEST)
            _log.warning("checkpoint service: refused a %r request: %s", msg.header.get("op"), e)
            channel.send({"ok": False, "error": f"bad request: {e}"})
            if msg.length:
                raise _Close from None  # its payload is not worth reading
            return
        try:
            self._dispatch(channel, req, msg)
        except CheckpointError as e:
            channel.send({"ok": False, "error": str(e)})

    def _dispatch(self, channel: wire.Channel, req: rq.Request, msg: wire.Message) -> None:
        k = self.keeper
        if isinstance(req, rq.Put):
            self._receive_replica(channel, req, msg)
        elif isinstance(req, rq.Commit):
            try:
                k.reserve(msg.length, f"checkpoint {req.id}'s metadata")
            except CheckpointError as e:
                auth.REFUSALS.count(SERVICE, auth.Reason.OVER_CAPACITY)
                channel.send({"ok": False, "error": str(e)})
                raise _Close from None  # its payload is not worth reading
            try:
                metadata = channel.recv_payload(msg)
            finally:
                k.release(msg.length)  # the commit counts what it keeps
            self._commit(req, metadata)
            channel.send({"ok": True})
        elif isinstance(req, rq.Begin):
            newest, refusal = k.begin(req.rank, req.nbytes, req.timeout, req.pid)
            reply: dict[str, Any] = {"ok": True, "newest": newest, "node": k.settings.node}
            if refusal is not None:
                # A save that asked not to wait (timeout 0) and found this node busy is skipped
                # by design, every step while a replica is slower than a step: not an error.
                quiet = refusal.busy and req.timeout == 0
                _log.log(logging.DEBUG if quiet else logging.ERROR, "checkpoint refused for rank %s: %s",
                         req.rank, refusal.reason)  # fmt: skip
                reply["refused"] = refusal.reason
                reply["busy"] = refusal.busy
            channel.send(reply)
        elif isinstance(req, rq.Open):
            path = k.open(req.id, req.name, req.size, req.rank)
            channel.send({"ok": True, "path": str(path)})
        elif isinstance(req, rq.Done):
            k.done(req.rank)
            channel.send({"ok": True})
        elif isinstance(req, rq.InventoryRequest):
            if req.pull is not None:
                self._pull_ahead = req.pull
                if not req.pull:
                    self._prefetch.stop()
            if req.wait:
                self._prefetch.wait()
            channel.send({"ok": True, "inventory": k.inventory().to_json()})
        elif isinstance(req, rq.MetadataRequest):
            channel.send({"ok": True}, k.metadata(req.id))
        elif isinstance(req, rq.Get):
            self._send_range(channel, req)
        else:
            first = k.restored(
                req.id, req.source.value, req.seconds, req.step, req.pid, req.local, req.fetched
            )
            channel.send({"ok": True})
            if first and self._on_restore is not None:
                self._on_restore(k.status())

    def _receive_replica(self, channel: wire.Channel, req: rq.Put, msg: wire.Message) -> None:
        refusal = self._replica_refusal(channel, req)
        if refusal is not None:
            auth.REFUSALS.count(SERVICE, auth.Reason.BAD_REQUEST)
            _log.warning(
                "checkpoint service: refused a replica of %s (checkpoint %d): %s", req.name, req.id, refusal
            )
            channel.send({"ok": False, "error": f"replica refused: {refusal}"})
            raise _Close from None  # its payload is not worth reading
        try:
            part = self.keeper.replica_target(req.id, req.name, req.size)
        except CheckpointError as e:
            channel.discard(msg)
            channel.send({"ok": False, "error": str(e)})
            return
        try:
            with open(part, "r+b") as f:
                channel.recv_to_file(msg, f)
        except BaseException:
            self.keeper.replica_failed(req.id, req.name, part)
            raise
        self.keeper.replica_done(req.id, req.name, part, req.size)
        channel.send({"ok": True})

    def _send_range(self, channel: wire.Channel, req: rq.Get) -> None:
        path = self.keeper.readable(req.id, req.name, req.offset, req.length)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{req.name} of checkpoint {req.id} went away: {e.strerror}") from e
        with open(fd, "rb") as f:
            channel.send_header({"ok": True}, req.length)
            channel.send_file(f, req.offset, req.length)

    def _commit(self, req: rq.Commit, metadata: bytes) -> None:
        cid = req.id
        try:
            codec.check_commit(metadata, req.required)
        except codec.UnsafeMetadata as e:
            auth.REFUSALS.count(SERVICE, auth.Reason.BAD_REQUEST)
            _log.warning("checkpoint service: refused the commit of checkpoint %d: %s", cid, e)
            raise CheckpointError(f"commit of checkpoint {cid} refused: {e}") from None
        ring = list(self._ring) or [self.endpoint]
        if not self.keeper.commit(cid, metadata, req.required, ring, req.step):
            return  # the same commit again (a retry): done already
        targets = ReplicaPlan(tuple(ring), self.settings.replicas).peers(self.endpoint)
        files = self.keeper.own_files(cid)
        if targets and files:
            self.keeper.outgoing(+1)
            self._jobs.put(lambda: self._replicate(cid, files, targets, ring))
        elif self._feed is not None and files:
            self._feed.offer(cid, files, ring)
        if ring[0] == self.endpoint and self.keeper.persist_due(cid):
            self.keeper.pin(cid)
            self._jobs.put(lambda: self._persist(cid, ring))

    def _replica_refusal(self, channel: wire.Channel, req: rq.Put) -> str | None:
        """Why the replica ``req`` is refused (not assigned to its sender by this round's ring)."""
        try:
            source = str(channel.sock.getpeername()[0])
            host = parse_endpoint(req.sender)[0] if req.sender is not None else None
        except (OSError, ValueError):
            return "its sender's address cannot be read"
        return replica_refusal(self._ring, self.endpoint, req.sender, host, source, self.settings.replicas)

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

    def _replicate(self, cid: int, files: list[tuple[str, int]], targets: list[str], ring: list[str]) -> None:
        """Send this node's ``files`` of ``cid`` to its ring ``targets``; then, once the next
        save may begin, hand them to the standbys' feed (the ring's replica goes first)."""
        began = time.monotonic()
        total = 0
        try:
            for target in targets:
                client = self.client(target)
                try:
                    for name, size in files:
                        client.put_file(cid, name, self.keeper.path_of(cid, name), size, sender=self.endpoint)
                        total += size
                except SecretMismatch:
                    self._judge_secret(ring)
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
            if self._feed is not None:
                self._feed.offer(cid, files, ring)
        seconds = time.monotonic() - began
        _log.debug("checkpoint %d: %s replicated to %s in %.3f s", cid, format_bytes(total), targets, seconds)
        if self._on_replicated is not None:
            self._on_replicated(cid, seconds, total)

    def _judge_secret(self, ring: Sequence[str]) -> None:
        """A peer and this node hold different secrets: find out which (:mod:`.secretcheck`);
        when it is this node, :attr:`secret_mismatch` says so (its agent stops on it)."""
        if self.secret_mismatch is not None:
            return

        def handshake(endpoint: str) -> None:
            open_channel(endpoint, self._secret.key, self.limits.handshake_timeout, self._source).sock.close()

        verdict = judge_secret(ring, self.endpoint, handshake)
        message = verdict.message(self.endpoint)
        _log.warning("%s", message)
        if verdict.odd:
            self.secret_mismatch = message

    def _persist(self, cid: int, ring: list[str]) -> None:
        from kelastic.agent.checkpoint.persist import write_durable

        try:
            assert self.settings.persist_dir is not None
            began = time.monotonic()
            path = write_durable(
                self.keeper, cid, ring, DurableStore(self.settings.persist_dir), self.settings.persist_keep,
                self.client,
            )  # fmt: skip
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
