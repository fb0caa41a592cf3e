"""Code that runs inside a rank process, before the user's entrypoint.

Both kinds of rank get the same treatment before user code runs: their own session
(so the rank's tree is one process group), the parent-death signal (so they die with
the launcher even if it is SIGKILLed), their environment and their stream redirects.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import record
from .handshake import RankEnds, finish
from .proctree import set_parent_death_signal
from .watchdog import close_inherited_pipe

__all__ = ["BINARY_TRAMPOLINE", "run_callable"]

# Runs as `python -I -S -c BINARY_TRAMPOLINE <launcher pid> <binary> <args...>` in a fresh
# session created by Popen: set the parent-death signal, make sure the launcher is still
# there, then exec the binary in place (same pid). prctl survives execve. Kept tiny and
# free of imports beyond ctypes so the detour costs a few milliseconds per rank.
BINARY_TRAMPOLINE = """\
import ctypes, os, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write(f"kelastic: cannot execute {sys.argv[2]!r}: {exc}\\n")
    os._exit(127)
"""


def _redirect(fd: int, path: str) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _text_stream(current: Any, fd: int) -> Any:
    try:
        if current is not None and current.fileno() == fd:
            return current
    except (AttributeError, OSError, ValueError):
        pass
    return open(fd, "w", buffering=1, closefd=False, errors="backslashreplace")


def _store(value: Any, ret_path: str) -> None:
    tmp = ret_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, ret_path)


def _call_and_store(fn: Callable[..., Any], args: Sequence[Any], ret_path: str) -> bool:
    _store(fn(*args), ret_path)
    return True


def run_callable(
    local_rank: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    env: Mapping[str, str],
    stdout_path: str,
    stderr_path: str,
    ret_path: str,
    launcher_pid: int,
    direct_child: bool,
    ends: RankEnds | None = None,
) -> None:
    """Target of a callable rank's ``multiprocessing.Process``.

    Runs ``fn(*args)`` under :func:`record`; its return value is pickled to ``ret_path``
    (``None`` when ``fn`` called ``sys.exit(0)``), then, with ``ends``, the rank waits
    for its launcher's release (:mod:`.handshake`) before it returns. On an exception
    the traceback goes to stderr and the process exits with code 1 at once.
    """
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader (fork of a session leader cannot happen, but be lenient)
    set_parent_death_signal(signal.SIGKILL, launcher_pid if direct_child else None)
    if not direct_child and os.getppid() == 1:
        os._exit(137)  # forkserver already orphaned: the launcher is gone
    close_inherited_pipe()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    if stdout_path:
        _redirect(1, stdout_path)
    if stderr_path:
        _redirect(2, stderr_path)
    # A forked rank inherits the launcher's sys.stdout/sys.stderr objects, which may not
    # write to fds 1/2 (a test runner's capture, a logging wrapper): bind them to the fds.
    sys.stdout = _text_stream(sys.stdout, 1)
    sys.stderr = _text_stream(sys.stderr, 2)
    # Ranks are stopped by signals from the launcher; default handlers make them die
    # promptly rather than inherit whatever the launcher installed (fork start method).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    try:
        if not record(_call_and_store)(fn, args, ret_path):
            _store(None, ret_path)  # fn called sys.exit(0), which record turns into None
    except SystemExit:
        raise
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    if ends is not None:
        finish(ends)
    _destroy_process_groups()


#: How long a returned rank gives ``destroy_process_group`` before it ends anyway (seconds).
DESTROY_GRACE = 30.0


def _destroy_process_groups() -> None:
    """Destroy the process groups a rank's function left behind, before the interpreter ends.

    Many scripts return without ``destroy_process_group``. Their process group's threads
    (gloo's run loop) may still drop the last work item, which takes the GIL; if the
    interpreter is finalizing by then, CPython ends that thread with ``pthread_exit``,
    whose unwinding meets a ``noexcept`` destructor of torch's bindings: the rank dies of
    SIGABRT after its work was done and a finished job counts as failed. Destroying the
    groups here, while the interpreter is whole, joins those threads first. Only ranks that
    initialized ``torch.distributed`` pay for it; a destroy that does not return within
    :data:`DESTROY_GRACE` (an operation the script left pending on a dead peer) ends the
    rank with status 0: its value is stored and its launcher released it.
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
    except Exception:  # a torch the rank broke or half-imported: nothing of ours to tidy
        return
    import threading

    done = threading.Event()

    def _bounded() -> None:
        if not done.wait(DESTROY_GRACE):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    threading.Thread(target=_bounded, name="kelastic-destroy-grace", daemon=True).start()
    try:
        dist.destroy_process_group()
    except Exception as e:  # the work is done; a failed tidy-up must not fail the rank
        print(f"kelastic: destroy_process_group after the rank returned failed: {e}", file=sys.stderr)
    finally:
        done.set()
