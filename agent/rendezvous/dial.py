"""Reaching the rendezvous store from the agent's main thread: stoppable, never silent, bounded.

torch's ``TCPStore`` client connects and validates in C++: it retries a refused
connection until its timeout (up to ``join_timeout``), waits for the store's first
answer with no timeout at all (a socket that accepts but never answers holds it for
ever), and while it is blocked the agent's Python signal handlers do not run: SIGTERM
and SIGINT did nothing.

:func:`dial` asks first with a plain socket whether anything accepts at the endpoint
(:func:`probe`: refused, no answer, accepted), and only then creates the client, on a
daemon thread that the caller's thread waits for in Python: a signal's handler runs at
once and its exception ends the wait (a client still blocked in C++ is left behind;
the agent ends with ``os._exit``, see :mod:`kelastic.agent.process_exit`). An attempt
that has not answered in :data:`ATTEMPT_TIMEOUT` seconds is abandoned and another one
started, at most :data:`MAX_ABANDONED` times. Meanwhile the wait says what it waits for
(:mod:`kelastic.agent.waiting`): the store at HOST:PORT and what answers there. Past the
deadline it raises ``RendezvousConnectionError`` naming the endpoint, what answered and
the command that starts a store.
"""

from __future__ import annotations

import datetime
import enum
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from kelastic.agent.waiting import Wait

from .protocol import first_line

__all__ = ["ATTEMPT_TIMEOUT", "MAX_ABANDONED", "Reach", "dial", "probe", "start_hint"]

log = logging.getLogger(__name__)

#: A client that has not connected and validated in this many seconds is abandoned.
ATTEMPT_TIMEOUT = 10.0
#: At most this many abandoned clients (each a thread blocked in C++) per dial.
MAX_ABANDONED = 3
#: How long a probe waits for the endpoint to accept (seconds).
PROBE_TIMEOUT = 2.0
#: Pause between probes of an endpoint where nothing accepts (seconds).
RETRY_EVERY = 0.5


class Reach(enum.Enum):
    """What answers at an endpoint, as a plain socket sees it."""

    # Short: they end a progress line that must fit a terminal (with the endpoint before them).
    REFUSED = "connection refused"
    SILENT = "connect timed out"
    UNKNOWN_HOST = "unknown host name"
    UNREACHABLE = "unreachable"
    ACCEPTS = "accepts connections"


def probe(host: str, port: int, timeout: float) -> tuple[Reach, str]:
    """Whether anything accepts a TCP connection at host:port within ``timeout`` s, and the error if not."""
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.05)):
            return Reach.ACCEPTS, ""
    except ConnectionRefusedError as exc:
        return Reach.REFUSED, str(exc)
    except TimeoutError as exc:
        return Reach.SILENT, str(exc)
    except socket.gaierror as exc:
        return Reach.UNKNOWN_HOST, str(exc)
    except OSError as exc:
        return Reach.UNREACHABLE, str(exc)


def start_hint(host: str, port: int) -> str:
    """The command that serves a store at host:port, for messages."""
    return f"`kelastic-rendezvous --host {host} --port {port}`"


@dataclass
class _Attempt:
    """One client being created on a daemon thread."""

    started: float
    done: threading.Event = field(default_factory=threading.Event)
    store: dist.TCPStore | None = None
    error: BaseException | None = None


def _start_attempt(host: str, port: int) -> _Attempt:
    attempt = _Attempt(started=time.monotonic())

    def run() -> None:
        try:
            attempt.store = dist.TCPStore(
                host, port, None, False, datetime.timedelta(seconds=ATTEMPT_TIMEOUT)
            )
        except BaseException as exc:  # handed to the waiting thread
            attempt.error = exc
        finally:
            attempt.done.set()

    threading.Thread(target=run, name=f"kelastic-rdzv-dial {host}:{port}", daemon=True).start()
    return attempt


def dial(host: str, port: int, deadline: float, store_timeout: float) -> dist.TCPStore:
    """A client of the store at host:port, connected before ``deadline`` (monotonic).

    ``store_timeout``: the client's timeout for its operations afterwards (seconds).
    Raises ``RendezvousConnectionError`` past the deadline; a signal's exception ends it at once.
    """
    endpoint = f"{host}:{port}"
    attempt: _Attempt | None = None
    abandoned = 0
    state = "not tried yet"
    with Wait(f"the rendezvous store at {endpoint}", log) as wait:
        while True:
            now = time.monotonic()
            if attempt is None:
                reach, _ = probe(host, port, min(PROBE_TIMEOUT, max(deadline - now, 0.05)))
                if reach is Reach.ACCEPTS:
                    attempt = _start_attempt(host, port)
                    if not abandoned:
                        state = "accepts, no answer yet"
                else:
                    state = reach.value
            if attempt is not None:
                # In Python, with a timeout: the signal handlers run while it waits.
                attempt.done.wait(max(0.01, min(deadline, wait.next_at(), now + 1.0) - now))
                if attempt.done.is_set():
                    if attempt.store is not None:
                        attempt.store.set_timeout(datetime.timedelta(seconds=max(store_timeout, 0.1)))
                        return attempt.store
                    error = first_line(attempt.error) if attempt.error is not None else "no client"
                    state = f"accepts, but the client failed: {error}"
                    attempt = None
                elif time.monotonic() - attempt.started >= ATTEMPT_TIMEOUT:
                    state = "accepts, never answers: a kelastic-rendezvous store?"
                    if abandoned < MAX_ABANDONED:
                        abandoned += 1
                        attempt = None  # left blocked on its daemon thread; a fresh one next pass
            else:
                time.sleep(max(0.0, min(RETRY_EVERY, deadline - time.monotonic())))
            wait.update(f"the rendezvous store at {endpoint}: {state}")
            wait.tell()
            if time.monotonic() >= deadline:
                raise RendezvousConnectionError(
                    f"could not reach the kelastic rendezvous store at {endpoint}: {state}. "
                    f"Is {start_hint(host, port)} running and reachable from this node?"
                )
