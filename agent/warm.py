"""Warm worker starts: fork workers from a server that has already imported torch.

Starting a worker as ``python train.py`` pays for a fresh interpreter and for
``import torch`` on every (re)start, which dominates the time to recover from a
lost or added node. With ``kelastic-agent --warm-start`` the agent instead
starts ``multiprocessing``'s fork server once, early (while the rendezvous is
still going on), has it import :data:`PRELOAD`, and every worker start is a
``fork`` of that server running the script through :func:`run_script` (or
:func:`run_module` for ``-m``), i.e. ``runpy`` with ``__name__ == "__main__"``,
``sys.argv`` and ``sys.path[0]`` as ``python`` would set them.

``kelastic-agent`` imports torch itself (its rendezvous needs it), so rather than have
a second interpreter import it again, :func:`fork_forkserver` makes the fork server a
``fork`` of the agent taken right after that import, while the agent still runs a single
thread: one ``import torch`` per node instead of two, and the server is ready the
moment the agent is. Where that cannot be done safely (another thread already runs, a
Python whose fork server works differently, CUDA initialised in the agent: see
:mod:`kelastic.agent.devices`) it falls back to :func:`prewarm_forkserver`,
multiprocessing's own fresh server, a new interpreter whose workers can use CUDA.

The script's own imports. After torch the server also imports the modules the script
imports at its module level that are installed outside the script's folder (the
standard library, numpy, torchvision, transformers, ...; with ``-m``, outside the working
directory), so a worker (re)start does not pay for them either. The script has nothing
to do for it: the agent reads it with :mod:`ast` (:mod:`kelastic.agent.warmimports`),
never runs it. Not imported early: the script's own modules (its folder's files and
packages, which may read ``RANK`` or open files when imported), relative imports, and
anything imported inside a function, a class or an ``if`` (``if __name__ ==
"__main__":`` above all). A module whose import raises anything, or takes over
:data:`IMPORT_TIMEOUT` seconds (interrupted by SIGALRM), is skipped with one warning
naming it and the error, and each worker imports it itself, failing or not as it would
have (:func:`import_guarded`). The agent joins its first rendezvous once the server is
done (:func:`wait_ready`; multiprocessing's own server serves no worker before), and
the server logs at INFO which modules it imported. A fork server that dies is started
again by multiprocessing, fresh, without the script's modules.

What that changes for a package that does work at import time: it runs once, in the
fork server, before any worker exists and so before any rank's variable (``RANK``,
``LOCAL_RANK``, ``MASTER_ADDR``) is set, and every worker inherits its result. A package
that reads those variables, starts threads or initialises CUDA when imported (a fork of
a process that did cannot use CUDA; the server warns when it sees the CUDA driver
loaded) must be kept out: ``kelastic-agent --warm-imports torch`` (``PET_WARM_IMPORTS=torch``)
has the server import torch only.

Differences from a fresh interpreter a script may notice: torch and its installed
imports are already imported (so environment variables that torch reads at import
time come from the agent's environment; the agent sets ``OMP_NUM_THREADS=1`` in its own
environment first when several ranks share the node, as for regular starts),
and the ``__main__`` module is runpy's. Scripts that need a pristine
interpreter should not use ``--warm-start``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from kelastic.agent import devices

__all__ = [
    "AGENT_IMPORTS",
    "ENV_SCRIPT_IMPORTS",
    "IMPORT_TIMEOUT",
    "PRELOAD",
    "fork_forkserver",
    "import_guarded",
    "paused_gc",
    "preload",
    "prewarm_forkserver",
    "run_module",
    "run_script",
    "wait_ready",
]

#: Modules the fork server imports once, so that workers do not. ``torch._dynamo`` is what a
#: script's first ``torch.optim`` optimizer imports (over a second of CPU, about as much as
#: ``import torch``), so a forked worker reaches its first step without it. The checkpoint
#: modules (``torch.distributed.checkpoint`` and ``kelastic.checkpoint``, about 0.1 s together)
#: are what a restarted rank imports before its restore, often inside a function, where the
#: script's own imports (:mod:`kelastic.agent.warmimports`) do not look.
PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "kelastic.checkpoint",
    "kelastic.agent.multiprocessing.child",
)
#: What the agent itself needs of :data:`PRELOAD` (its rendezvous uses torch's store): it
#: imports these before :func:`fork_forkserver` forks, the server imports the rest after.
AGENT_IMPORTS: tuple[str, ...] = ("torch", "torch.distributed")
#: Seconds one of the script's modules may take to import in the server before it is
#: interrupted and left to the workers (:func:`import_guarded`).
IMPORT_TIMEOUT = 60.0
#: How the script's modules reach multiprocessing's own fork server (the fallback of
#: :func:`prewarm_forkserver`), comma-separated; :mod:`kelastic.agent.warm_preload` reads it.
ENV_SCRIPT_IMPORTS = "KELASTIC_WARM_IMPORTS"
#: The module that fallback server imports after :data:`PRELOAD` for the script's modules.
_FALLBACK_PRELOAD = "kelastic.agent.warm_preload"


def run_script(script: str, *args: str) -> None:
    """Run ``script`` as ``python script args...`` would, in the current process."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def run_module(module: str, *args: str) -> None:
    """Run ``module`` as ``python -m module args...`` would, in the current process."""
    sys.argv = [module, *args]
    sys.path.insert(0, os.getcwd())
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def prewarm_forkserver(preload: tuple[str, ...] = PRELOAD, script_modules: Sequence[str] = ()) -> None:
    """Start the fork server now and have it import ``preload``, then ``script_modules``
    through :func:`import_guarded` (idempotent; returns at once)."""
    if not script_modules:
        multiprocessing.set_forkserver_preload(list(preload))
        multiprocessing.forkserver.ensure_running()
        return
    # multiprocessing's server gives up on any error of a preload but ImportError: the
    # script's modules are imported by a module of ours that skips what fails.
    multiprocessing.set_forkserver_preload([*preload, _FALLBACK_PRELOAD])
    before = os.environ.get(ENV_SCRIPT_IMPORTS)
    os.environ[ENV_SCRIPT_IMPORTS] = ",".join(script_modules)  # the server inherits it
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            os.environ.pop(ENV_SCRIPT_IMPORTS, None)
        else:
            os.environ[ENV_SCRIPT_IMPORTS] = before


class _TookTooLong(BaseException):
    """Raised by SIGALRM in an import that ran past its time (no ``except Exception`` stops it)."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise _TookTooLong


def _import_within(name: str, timeout: float) -> None:
    """Import ``name``, interrupted by SIGALRM after ``timeout`` s where this thread can set
    a signal handler (the main thread; a fork server runs no other). A timer and handler
    set before are put back after, the timer less the time the import took."""
    try:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
    except ValueError:  # not the main thread: no time limit
        importlib.import_module(name)
        return
    began, delay, interval = time.monotonic(), 0.0, 0.0
    try:
        delay, interval = signal.setitimer(signal.ITIMER_REAL, timeout)
        importlib.import_module(name)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if delay > 0:  # someone else's alarm: still due, at the latest now
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, delay - (time.monotonic() - began)), interval)


def import_guarded(names: Sequence[str], log: logging.Logger, timeout: float = IMPORT_TIMEOUT) -> list[str]:
    """Import each of ``names`` (the script's modules, :mod:`kelastic.agent.warmimports`),
    skipping, with one warning naming it and the error, one whose import raises anything
    (but KeyboardInterrupt) or takes over ``timeout`` s: each worker then imports it
    itself, and fails or succeeds as it would have. Returns the names imported (or there
    already) and logs at INFO those it imported."""
    done: list[str] = []
    already = {name for name in names if name in sys.modules}
    for name in names:
        try:
            _import_within(name, timeout)
        except _TookTooLong:  # also an alarm that came as the import returned
            log.warning(
                "warm start: importing %s took over %gs; the workers import it themselves", name, timeout
            )
            continue
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit too: a module's import must not end the server
            message = " ".join(str(e).split())[:200]  # one line, whatever the module raised
            what = f"{type(e).__name__}: {message}" if message else type(e).__name__
            log.warning("warm start: importing %s failed (%s); the workers import it themselves", name, what)
            continue
        done.append(name)
    if new := [name for name in done if name not in already]:
        log.info("warm start: the fork server imported the script's modules %s", ", ".join(new))
        if devices.cuda_touched():
            log.warning(
                "warm start: importing the script's modules initialised CUDA in the fork server, "
                "so the workers forked from it cannot use CUDA; run the agent with --warm-imports torch"
            )
    return done


def server_logger(handlers: Sequence[logging.Handler], level: int) -> logging.Logger:
    """The fork server's own logger, writing to ``handlers`` at ``level`` whatever becomes of
    the root logger's set-up (the server gives it back to the script: _as_fresh_interpreter)."""
    log = logging.getLogger(f"{__name__}.server")
    log.handlers = list(handlers)
    log.propagate = False
    log.setLevel(level)
    return log


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import ``modules`` into this process (what the fork server would import)."""
    with paused_gc():
        for name in modules:
            importlib.import_module(name)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off for the block (it is turned back on after, if it was on).

    ``import torch`` creates hundreds of thousands of long-lived objects, and every collection
    meanwhile scans them for nothing: without it ``torch`` imports about 10% faster and
    ``torch._dynamo`` about 30% (measured on CPython 3.11, torch 2.13).
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


#: The read end of the forked server's "ready" pipe, until :func:`wait_ready` saw it.
_ready_fd: int | None = None

#: ``multiprocessing.forkserver.main``'s parameters on the Pythons whose fork server
#: :func:`fork_forkserver` knows how to start (3.10 to 3.13; 3.14 added an authkey).
_KNOWN_MAIN = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")


def _forkable() -> str | None:
    """Why the fork server cannot be forked from this process, or None when it can."""
    if threading.active_count() > 1:
        return "another thread is running"
    if devices.cuda_touched():
        # torch would call every fork of this process a "bad fork" and refuse CUDA there.
        return "CUDA was initialised in this process (its forks could not use it)"
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is None or hasattr(server, "_forkserver_authkey"):
        return "this Python's fork server is not the one kelastic knows"
    if not all(hasattr(server, a) for a in ("_lock", "_forkserver_pid", "_forkserver_address")):
        return "this Python's fork server is not the one kelastic knows"
    if not hasattr(multiprocessing.connection, "arbitrary_address"):
        return "this Python's fork server is not the one kelastic knows"
    if tuple(inspect.signature(multiprocessing.forkserver.main).parameters) != _KNOWN_MAIN:
        return "this Python's fork server is not the one kelastic knows"
    return None


def fork_forkserver(
    modules: tuple[str, ...] = PRELOAD,
    *,
    here: tuple[str, ...] = AGENT_IMPORTS,
    script_modules: Sequence[str] = (),
) -> bool:
    """Import ``here`` in this process, then make multiprocessing's fork server a fork of it
    that imports the rest of ``modules``, then ``script_modules`` (:func:`import_guarded`),
    on its own, while this process goes on (the agent to its rendezvous); the server
    serves its first worker once they are imported, which :func:`wait_ready` tells.

    Call it while this process runs a single thread (before any server, watcher or
    signal handler of the agent starts). Returns True when the server was forked (it
    holds everything imported so far), False when it fell back to
    :func:`prewarm_forkserver` (the reason is logged at INFO) or a server was already
    running. Either way later ``forkserver`` starts use the server, and one that dies is
    restarted by multiprocessing as a fresh interpreter that imports ``modules``.

    The imports run with the garbage collector paused (:func:`paused_gc`), and what is
    alive at the fork, and in the server once it has imported the rest, is frozen
    (``gc.freeze()``): no later collection scans it or touches its memory pages, so the
    agent, the server and the workers share them. The little garbage the imports left
    (a few thousand objects) is kept with it.
    """
    with paused_gc():
        return _fork_forkserver(modules, here, script_modules)


def _fork_forkserver(modules: tuple[str, ...], here: tuple[str, ...], script_modules: Sequence[str]) -> bool:
    multiprocessing.set_forkserver_preload(list(modules))
    # Private state of CPython's fork server, checked by _forkable() before it is used.
    server: Any = getattr(multiprocessing.forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None:
        return False  # already running (ensure_running checks that it still is)
    preload(here)
    why = _forkable()
    if why is not None:
        logging.getLogger(__name__).info("starting a fresh fork server: %s", why)
        prewarm_forkserver(modules, script_modules)
        return False
    from multiprocessing import resource_tracker, util

    private: Any = multiprocessing.connection  # arbitrary_address is not in its stubs

    with server._lock:
        # Started first so that the fork server and the workers share it, as they would
        # with multiprocessing's own start.
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = private.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            # Every client holds the write end of the "alive" pipe: when they are all
            # gone, the server reads EOF and exits. The server says on "ready" when it has
            # imported the rest (or closes it by dying).
            alive_r, alive_w = os.pipe()
            ready_r, ready_w = os.pipe()
            # Output still buffered here would be written again by the server's children.
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            # What is alive now lives on in both processes: no collection of either ever
            # touches it (which would copy its memory pages), as the gc module recommends
            # for a process that forks without exec.
            gc.freeze()
            try:
                pid = os.fork()
            except BaseException:
                for fd in (alive_r, alive_w, ready_r, ready_w):
                    os.close(fd)
                raise
            if pid == 0:  # the fork server
                code = 0
                try:
                    os.close(alive_w)
                    os.close(ready_r)
                    # Held by the parent at the fork: a script's own forkserver use in a
                    # worker must not find it taken forever.
                    server._lock = threading.Lock()
                    root = logging.getLogger()
                    log = server_logger(root.handlers, root.getEffectiveLevel())
                    _as_fresh_interpreter()
                    for name in modules:  # with the collector still paused
                        with contextlib.suppress(ImportError):  # as multiprocessing's preload
                            importlib.import_module(name)
                    import_guarded(script_modules, log)
                    # The workers are forks of this server: same reasoning as above, and
                    # they start with the collector on, as a fresh interpreter does.
                    gc.freeze()
                    gc.enable()
                    os.write(ready_w, b"1")
                    os.close(ready_w)
                    multiprocessing.forkserver.main(listener.fileno(), alive_r, [])
                except SystemExit as e:  # main() ends so when the last client is gone
                    code = e.code if isinstance(e.code, int) else 0
                except BaseException:
                    code = 1
                    sys.excepthook(*sys.exc_info())
                finally:
                    os._exit(code)
            os.close(alive_r)
            os.close(ready_w)
        global _ready_fd
        _ready_fd = ready_r
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def wait_ready(timeout: float) -> bool | None:
    """Wait up to ``timeout`` s for the server :func:`fork_forkserver` forked to have imported
    its modules. True once it has (or died: nothing left to wait for), False on time-out,
    None when there is nothing to wait for (no forked server, or already waited)."""
    global _ready_fd
    fd = _ready_fd
    if fd is None:
        return None
    readable, _, _ = select.select([fd], [], [], max(0.0, timeout))
    if not readable:
        return False
    os.close(fd)
    _ready_fd = None
    return True


def _as_fresh_interpreter() -> None:
    """Undo, in the forked server, what the agent configured that a script expects untouched."""
    # A script's logging.basicConfig() must take effect, as in a fresh interpreter.
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
