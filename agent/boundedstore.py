"""The rendezvous store's server with bounds: torch's ``TCPStore`` protocol, served by kelastic.

``kelastic-rendezvous`` answers torch's ``TCPStore`` clients (the agents, the operator) on
the wire protocol of torch's libuv store, but holds what they write within limits
(:class:`StoreLimits`): a value's size, the number of keys, the bytes of all keys and values,
the keys of one request and the connections at once. What exceeds a limit is refused: the
server logs a line saying what and from where (at most one per :data:`LOG_INTERVAL`
seconds per kind, every refusal counted in :attr:`BoundedStore.refused`) and closes that client's
connection, since the protocol has no error reply (a ``set`` has no reply at all); nothing
is stored. A client that sends half a request and then nothing is cut off after
``request_timeout``; an idle one (a watcher blocked in ``get``) is not.

The protocol (torch 2.x, ``TCPStoreLibUvBackend.cpp``): a connection starts with
``VALIDATE`` and a magic number; each request is a query type (one byte) and its arguments:
strings and byte vectors as a u64 length and the bytes, counts as u64, numbers as i64,
all little-endian. Replies: a byte vector, an i64, or one byte (``CHECK``: 0 ready, 1 not;
``WAIT``: 0 once every key exists, 1 for a ``CANCEL_WAIT``). Queues, ``LIST_KEYS`` and
``BARRIER``, which kelastic never uses, are refused. Two answers differ from torch's, both
so that a stranger's write cannot wedge the job: an ``add`` to a key that holds no number
starts it from 0 (torch's store closes the adder's connection, every time), and a
``compare_set`` that writes nothing wakes no waiter (torch's wakes every waiter of the key).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import struct
import time
from dataclasses import dataclass, field

__all__ = ["LOG_INTERVAL", "BoundedStore", "StoreLimits"]

log = logging.getLogger(__name__)

MiB = 1 << 20
_MAGIC = 0x3C85F7CE
#: What a key costs beyond its bytes, in the total (the dict entry and the objects).
KEY_OVERHEAD = 128
#: Refusals are logged at most once per this many seconds (each is counted).
LOG_INTERVAL = 10.0


class Query(enum.IntEnum):
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13


@dataclass(frozen=True)
class StoreLimits:
    """What the store holds at most (``kelastic-rendezvous --max-*``)."""

    value_bytes: int = 1 * MiB
    keys: int = 1_000_000
    total_bytes: int = 128 * MiB
    key_bytes: int = 8 * 1024
    batch_keys: int = 128 * 1024
    connections: int = 4096
    request_timeout: float = 30.0
    #: Bytes held for requests in flight: keys and values being read, replies being sent,
    #: the keys of waits (``--max-buffer-bytes``).
    buffer_bytes: int = 64 * MiB


class Refused(Exception):
    """A request over a limit (``kind`` names which), or one that is not the protocol: the
    connection is closed."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


#: What a key costs in the buffer while a request holds it, beyond its bytes.
KEY_BUFFER_OVERHEAD = 64
#: Bytes the server reads from a connection at a time, buffers of it at most (about three
#: times this) before it stops reading, and of its answers before it waits for the client:
#: what one connection costs beside its request.
READ_CHUNK = 4 * 1024


@dataclass
class _Held:
    """Bytes of the buffer one request (or one wait) holds."""

    bytes: int = 0


@dataclass
class _Waiter:
    missing: set[str]
    writer: asyncio.StreamWriter
    held: _Held = field(default_factory=_Held)


@dataclass
class BoundedStore:
    """The keys and values, the clients waiting for keys, and the count of refusals (one event loop)."""

    limits: StoreLimits = field(default_factory=StoreLimits)
    data: dict[str, bytes] = field(default_factory=dict)
    total: int = 0
    refused: int = 0
    #: When each kind of refusal was last logged.
    _logged: dict[str, float] = field(default_factory=dict)
    _waiters: dict[str, list[_Waiter]] = field(default_factory=dict)
    _waiting: dict[asyncio.StreamWriter, _Waiter] = field(default_factory=dict)
    connections: int = 0
    #: The clients being served, so that a stop can cut them off (:meth:`close_connections`).
    _clients: set[asyncio.StreamWriter] = field(default_factory=set)
    #: Set while no client is being served.
    _none_served: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by :meth:`close_connections`: the server stops and serves no one more.
    _stopping: bool = False
    #: Bytes of the buffer held by requests in flight and waits (``limits.buffer_bytes``).
    buffered: int = 0

    def _hold(self, held: _Held, n: int, what: str) -> None:
        """Count ``n`` bytes of ``what`` against the buffer before they are read or built."""
        if self.buffered + n > self.limits.buffer_bytes:
            raise Refused(
                f"{what} of {n} bytes: {self.buffered} bytes of requests are being read, answered or "
                f"waited on (--max-buffer-bytes {self.limits.buffer_bytes})",
                "buffer",
            )
        self.buffered += n
        held.bytes += n

    def _release(self, held: _Held) -> None:
        self.buffered -= held.bytes
        held.bytes = 0

    # -- the data, within the limits --------------------------------------------------------
    def _put(self, key: str, value: bytes) -> None:
        lim = self.limits
        if len(value) > lim.value_bytes:
            raise Refused(
                f"a value of {len(value)} bytes for {key!r} (--max-value-bytes {lim.value_bytes})", "value"
            )
        old = self.data.get(key)
        if old is None and len(self.data) >= lim.keys:
            raise Refused(
                f"a new key {key!r}: the store holds {len(self.data)} keys (--max-keys {lim.keys})", "keys"
            )
        grown = self.total + len(value) - (len(old) if old is not None else -(len(key) + KEY_OVERHEAD))
        if grown > lim.total_bytes and grown > self.total:
            raise Refused(
                f"{len(value)} bytes for {key!r}: the store would hold {grown} bytes "
                f"(--max-total-bytes {lim.total_bytes})",
                "total",
            )
        self.data[key] = value
        self.total = grown
        self._wake(key)

    def _delete(self, key: str) -> int:
        old = self.data.pop(key, None)
        if old is None:
            return 0
        self.total -= len(old) + len(key) + KEY_OVERHEAD
        return 1

    def _wake(self, key: str) -> None:
        for waiter in self._waiters.pop(key, []):
            waiter.missing.discard(key)
            if not waiter.missing and self._waiting.get(waiter.writer) is waiter:
                del self._waiting[waiter.writer]
                self._release(waiter.held)
                waiter.writer.write(b"\x00")  # STOP_WAITING

    def _cancel(self, writer: asyncio.StreamWriter) -> None:
        waiter = self._waiting.pop(writer, None)
        if waiter is None:
            return
        self._release(waiter.held)
        for key in waiter.missing:
            rest = [w for w in self._waiters.get(key, []) if w is not waiter]
            if rest:
                self._waiters[key] = rest
            else:
                self._waiters.pop(key, None)

    def _refuse(self, peer: str, why: str, kind: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._logged.get(kind, float("-inf")) >= LOG_INTERVAL:
            self._logged[kind] = now
            log.warning(
                "kelastic-rendezvous: refused %s from %s and closed its connection (%d refused so far; "
                "each kind logged at most every %gs)",
                why,
                peer,
                self.refused,
                LOG_INTERVAL,
            )

    # -- the connections --------------------------------------------------------------------
    def close_connections(self) -> None:
        """Cut every client off and serve no new one: the server stops.

        Each :meth:`serve` then returns at its next read or write (:meth:`served` waits for
        that). Closing the connections, rather than cancelling their tasks, is what makes a
        stop prompt: a cancellation that reaches a task as its ``wait_for`` completes is lost
        (Python 3.11), and that task would go on serving a busy client until SIGKILL.
        """
        self._stopping = True
        for writer in list(self._clients):
            writer.transport.abort()

    async def served(self) -> None:
        """Return once no client is being served (after :meth:`close_connections`: promptly)."""
        while self.connections:
            self._none_served.clear()
            await self._none_served.wait()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client: validate, then requests until it closes or is refused."""
        if self._stopping:
            writer.transport.abort()
            return
        host, port = (writer.get_extra_info("peername") or ("?", "?"))[:2]
        peer = f"{host}:{port}"
        if self.connections >= self.limits.connections:
            self._refuse(
                peer, f"a connection: {self.connections} are open (--max-connections)", "connections"
            )
            writer.close()
            return
        self.connections += 1
        self._clients.add(writer)
        held = _Held()
        # Read at most READ_CHUNK at a time (asyncio reads 256 KiB): with the reader's limit,
        # a connection buffers some 3 READ_CHUNKs beside what its request holds.
        writer.transport.max_size = READ_CHUNK  # type: ignore[attr-defined]
        # And its answers wait for the client (``drain``) past READ_CHUNK, not asyncio's 64 KiB.
        writer.transport.set_write_buffer_limits(high=READ_CHUNK)
        try:
            if await self._within(reader, self._validation) != _MAGIC:
                raise Refused("a connection that did not begin with torch's TCPStore validation", "protocol")
            while True:
                kind = await reader.read(1)
                if not kind:
                    return
                await self._within(reader, self._request, kind[0], writer, held)
                # A client that does not read its answers is cut off like one that does not
                # send its request: the answer holds the buffer until it went out.
                try:
                    await asyncio.wait_for(writer.drain(), self.limits.request_timeout)
                except TimeoutError:
                    raise Refused(
                        f"an answer not read within {self.limits.request_timeout:g}s", "timeout"
                    ) from None
                self._release(held)
        except Refused as exc:
            self._refuse(peer, str(exc), exc.kind)
        except TimeoutError:
            self._refuse(peer, f"a request not sent whole within {self.limits.request_timeout:g}s", "timeout")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # the server stops: nothing more to serve this client
        finally:
            self.connections -= 1
            self._clients.discard(writer)
            self._release(held)
            self._cancel(writer)
            writer.close()
            if not self.connections:
                self._none_served.set()

    async def _within(self, reader: asyncio.StreamReader, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.wait_for(fn(reader, *args), self.limits.request_timeout)

    @staticmethod
    async def _validation(reader: asyncio.StreamReader) -> int:
        """The magic number of a first message ``VALIDATE``, else -1."""
        if (await reader.readexactly(1))[0] != Query.VALIDATE:
            return -1
        return int(struct.unpack("<I", await reader.readexactly(4))[0])

    @staticmethod
    async def _u64(reader: asyncio.StreamReader) -> int:
        return int(struct.unpack("<Q", await reader.readexactly(8))[0])

    async def _key(self, reader: asyncio.StreamReader, held: _Held) -> str:
        n = await self._u64(reader)
        if n > self.limits.key_bytes:
            raise Refused(f"a key of {n} bytes (at most {self.limits.key_bytes})", "request")
        self._hold(held, n + KEY_BUFFER_OVERHEAD, "a key")
        return (await reader.readexactly(n)).decode("utf-8", "surrogateescape")

    async def _value(self, reader: asyncio.StreamReader, held: _Held) -> bytes:
        n = await self._u64(reader)
        if n > self.limits.value_bytes:
            raise Refused(
                f"a value of {n} bytes (--max-value-bytes {self.limits.value_bytes}), unread", "value"
            )
        self._hold(held, n, "a value")
        return await reader.readexactly(n)

    async def _keys(self, reader: asyncio.StreamReader, held: _Held) -> list[str]:
        n = await self._u64(reader)
        if n > self.limits.batch_keys:
            raise Refused(f"a request for {n} keys (at most {self.limits.batch_keys})", "request")
        return [await self._key(reader, held) for _ in range(n)]

    def _reply(self, w: asyncio.StreamWriter, held: _Held, values: list[bytes]) -> None:
        """Write the byte vectors ``values``, counted against the buffer before they are built."""
        self._hold(held, sum(len(v) + 8 for v in values), "an answer")
        w.write(b"".join(_vector(v) for v in values))

    async def _request(
        self, reader: asyncio.StreamReader, kind: int, w: asyncio.StreamWriter, held: _Held
    ) -> None:
        try:
            query = Query(kind)
        except ValueError:
            raise Refused(f"query type {kind}, which kelastic's store does not serve", "protocol") from None
        if query is Query.SET:
            key = await self._key(reader, held)
            self._put(key, await self._value(reader, held))
        elif query is Query.COMPARE_SET:
            key = await self._key(reader, held)
            expected, desired = await self._value(reader, held), await self._value(reader, held)
            current = self.data.get(key)
            if current is None:
                if expected:
                    self._reply(w, held, [expected])  # torch's answer for a missing key
                    return
                self._put(key, desired)
            elif current == expected:
                self._put(key, desired)
            self._reply(w, held, [self.data[key]])
        elif query is Query.GET:
            self._reply(w, held, [self.data.get(await self._key(reader, held), b"")])
        elif query is Query.ADD:
            key, delta = await self._key(reader, held), struct.unpack("<q", await reader.readexactly(8))[0]
            try:
                value = int(self.data.get(key, b"0")) + delta
            except ValueError:
                # A counter a stranger overwrote with text starts again from 0 (torch's store
                # would close every adder's connection from then on: the counter lost for good).
                value = delta
            self._put(key, str(value).encode())
            w.write(struct.pack("<q", value))
        elif query is Query.CHECK:
            keys = await self._keys(reader, held)
            w.write(b"\x00" if all(k in self.data for k in keys) else b"\x01")
        elif query is Query.WAIT:
            self._wait(await self._keys(reader, held), w, held)
        elif query is Query.GETNUMKEYS:
            w.write(struct.pack("<q", len(self.data)))
        elif query is Query.DELETE_KEY:
            w.write(struct.pack("<q", self._delete(await self._key(reader, held))))
        elif query is Query.APPEND:
            key, more = await self._key(reader, held), await self._value(reader, held)
            self._put(key, self.data.get(key, b"") + more)
        elif query is Query.MULTI_GET:
            self._reply(w, held, [self.data.get(k, b"") for k in await self._keys(reader, held)])
        elif query is Query.MULTI_SET:
            n = await self._u64(reader)
            if n > self.limits.batch_keys:
                raise Refused(f"a request for {n} keys (at most {self.limits.batch_keys})", "request")
            for _ in range(n):
                key = await self._key(reader, held)
                self._put(key, await self._value(reader, held))
        elif query is Query.CANCEL_WAIT:
            self._cancel(w)
            w.write(b"\x01")  # WAIT_CANCELED
        elif query is Query.PING:
            w.write(await reader.readexactly(4))
        else:
            raise Refused(f"a second validation ({query.name})", "protocol")

    def _wait(self, keys: list[str], w: asyncio.StreamWriter, held: _Held) -> None:
        missing = {k for k in keys if k not in self.data}
        if not missing:
            w.write(b"\x00")
            return
        self._cancel(w)
        # The keys waited for stay in the buffer until the wait ends (woken or cancelled).
        waiter = _Waiter(missing, w, _Held(held.bytes))
        held.bytes = 0
        self._waiting[w] = waiter
        for key in missing:
            self._waiters.setdefault(key, []).append(waiter)


def _vector(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value
