"""The finish handshake of callable ranks: a rank that returned stays alive until released.

A rank that runs a function hands back its return value, says so to its launcher, and
then blocks until the launcher releases it; only then does its process exit. The
launcher releases every rank at once, when all local ranks have returned (what torch's
``start_processes`` does with a shared event), or, when the context was started with
``hold=True``, when its owner says so (the agent: after its exit barrier, so that no
rank of the job exits while a rank on another node still runs its function).

Why a finished rank must not exit at once: a collective's last work item is released
by the process group's own thread (gloo's ``pt_gloo_runloop``) a moment *after* the
call returned in Python, and releasing it drops Python references, which needs the
GIL. A rank that returns without ``destroy_process_group`` and exits straight away
can reach interpreter finalisation first; the thread that then asks for the GIL is
ended by the interpreter, which unwinds through a ``noexcept`` destructor: the rank
dies of SIGABRT (``terminate called without an active exception``) after its work was
done, and the launcher reports a finished job as failed. Blocking on the release, with
the GIL free, lets those threads finish first.

Mechanism (two pipes per context, raw bytes through the ``Connection`` objects
``multiprocessing`` already knows how to hand to spawned, forked and forkserver
children): each rank writes one byte to *returned* after its value is stored; the
launcher wakes on it (it is one of the fds ``wait`` selects on), and releases by
writing one byte per rank to *release*, from which each waiting rank reads one. No
lock is shared with the ranks, so a rank killed at any point can block nobody (a
shared ``multiprocessing.Event`` would deadlock its setter if a rank died holding its
lock). A rank also leaves its wait when every write end of *release* is closed (its
launcher is gone).
"""

from __future__ import annotations

import contextlib
import os
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["FinishHandshake", "RankEnds", "finish"]

#: What a rank holds: (write end of *returned*, read end of *release*, launcher-side ends to
#: close in a forked child, which inherits them).
RankEnds = tuple[Connection, Connection, tuple[Connection, ...]]


class FinishHandshake:
    """The launcher's side of the handshake for ``nprocs`` ranks of one context.

    ``rank_ends`` goes into every rank's arguments; ``started`` is called once they are
    all started; ``fileno`` is the fd to select on while ranks may still report;
    ``drain`` reads their reports; ``release`` (idempotent) lets every rank go;
    ``close`` frees the pipes.
    """

    def __init__(self, mp_context: Any, nprocs: int, *, forked: bool) -> None:
        # typeshed gives get_context(str) the BaseContext type; every concrete one has Pipe.
        self._returned_r, self._returned_w = mp_context.Pipe(duplex=False)
        self._release_r, self._release_w = mp_context.Pipe(duplex=False)
        self._nprocs = nprocs
        self._forked = forked
        self._released = False
        self._eof = False
        os.set_blocking(self._returned_r.fileno(), False)

    def rank_ends(self) -> RankEnds:
        # A forked rank inherits the launcher's ends as well: it closes them, so that the
        # launcher's death still closes every write end of *release*.
        drop = (self._returned_r, self._release_w) if self._forked else ()
        return self._returned_w, self._release_r, drop

    def started(self) -> None:
        """The ranks hold their own copies now: close the launcher's copies of the rank ends."""
        for conn in (self._returned_w, self._release_r):
            conn.close()

    def fileno(self) -> int | None:
        """The fd that becomes readable when a rank reports; None once none can any more."""
        return None if self._eof or self._returned_r.closed else self._returned_r.fileno()

    def drain(self) -> None:
        """Read the reports waiting in the pipe (never blocks)."""
        fd = self.fileno()
        while fd is not None:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._eof = True  # every rank closed its end: nothing more will come
                return

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Let every waiting rank exit (idempotent)."""
        if self._released or self._release_w.closed:
            return
        self._released = True
        try:
            os.write(self._release_w.fileno(), b"\x01" * self._nprocs)
        except OSError:
            pass  # every rank is gone already: nobody to release

    def close(self) -> None:
        for conn in (self._returned_r, self._returned_w, self._release_r, self._release_w):
            with contextlib.suppress(OSError):
                conn.close()


def finish(ends: RankEnds) -> None:
    """In a rank whose function returned and whose value is stored: report, then wait for
    the release (or for the launcher to be gone). Blocks with the GIL released."""
    returned_w, release_r, drop = ends
    for conn in drop:
        with contextlib.suppress(OSError):
            conn.close()
    try:
        os.write(returned_w.fileno(), b"\x01")
    except OSError:
        pass  # the launcher is gone; the read below returns at once
    finally:
        with contextlib.suppress(OSError):
            returned_w.close()
    try:
        os.read(release_r.fileno(), 1)  # b"" when every write end is closed
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            release_r.close()
