"""Run process creation on a thread that lives as long as the process.

The parent-death signal (``PR_SET_PDEATHSIG``) fires when the *thread* that forked
the child exits, not the process. If a rank were forked from a short-lived thread
(an agent's helper thread, a thread pool), the rank would be SIGKILLed when that
thread ended. So every fork happens either on the main thread (which lives until the
interpreter exits) or on one dedicated daemon thread created here.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar, cast

__all__ = ["run_on_forking_thread"]

T = TypeVar("T")

_lock = threading.Lock()
_queue: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
_thread: threading.Thread | None = None


def _serve() -> None:
    while True:
        fn, fut = _queue.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)


def run_on_forking_thread(fn: Callable[[], T], timeout: float = 120.0) -> T:
    """Call ``fn`` on a thread whose lifetime is the process's and return its result.

    On the main thread ``fn`` runs inline. Elsewhere it runs on the shared forking
    thread; ``TimeoutError`` if it has not finished within ``timeout`` seconds.
    """
    global _thread
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name="kelastic-forker", daemon=True)
            _thread.start()
    fut: Future[object] = Future()
    _queue.put((fn, fut))
    try:
        # The queue holds every caller's work, so it is typed for object; this one is fn's.
        return cast(T, fut.result(timeout=timeout))
    except TimeoutError as exc:
        raise TimeoutError(
            f"starting processes did not finish within {timeout} s on the forking thread"
        ) from exc
