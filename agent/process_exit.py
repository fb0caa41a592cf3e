"""How the agent's process ends: its clean-up, then ``os._exit``; never the interpreter's finalization.

A torch call that waits on the network (a store ``get``, a connect, an ``add`` to a
store that is gone) releases the GIL and may stay blocked long after the agent
decided to exit: the rendezvous handler's event watcher on a connection a network
partition left stale (it was replaced, and nothing can wake it: a ``TCPStore``
cannot be closed from another thread), a keep-alive writing to a lost store. Such
threads are daemons, so the exit does not wait for them. But CPython before 3.14
ends a daemon thread that takes the GIL back while the interpreter finalizes with
``pthread_exit``, whose forced unwinding reaches the ``noexcept`` destructor of
pybind11's ``gil_scoped_release`` in torch's binding: the C++ runtime calls
``std::terminate`` and the process aborts (SIGABRT, ``terminate called without an
active exception``), after a job that trained to the end. Whether it does depends
only on when the blocked call returns, so no order of releasing the agent's objects
prevents it.

:func:`exit_process` does for the program what the end of the interpreter does (joins
the threads that are not daemons, runs the ``atexit`` callbacks: logging's flush,
multiprocessing's clean-up, the rendezvous handlers' stop) and flushes the standard
streams, then ends the process with ``os._exit``: a daemon thread still blocked in
torch is never woken into a finalizing interpreter. C++ static destructors do not
run either (the kernel releases the process's memory, sockets and files).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_process"]


def exit_process(status: int) -> NoReturn:
    """Finish the program's clean-up and end the process with ``status``, without finalizing.

    Joins the non-daemon threads, then runs and clears the ``atexit`` callbacks (an
    exception in one is printed, as at a normal exit, and the others still run), then
    flushes ``sys.stdout`` and ``sys.stderr``. The exit status is ``status`` whatever
    happens meanwhile (a signal during the clean-up included). Never returns.
    """
    try:
        _join_non_daemon_threads()
        # What Python runs at exit, in the same order; they are cleared once run.
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing left to save
                pass
        os._exit(status)


def _join_non_daemon_threads() -> None:
    """What the interpreter waits for before it runs the ``atexit`` callbacks."""
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and not thread.daemon and thread is not threading.main_thread():
            thread.join()
