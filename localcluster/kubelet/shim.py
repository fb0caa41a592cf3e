"""The first process of every container: makes the container's processes die with the kubelet.

Run by file path (not imported as part of the package, so it starts in a few
milliseconds)::

    python -I -S shim.py KUBELET_PID COMMAND [ARGS...]

It leads the container's process group, starts COMMAND in that group, and
mirrors its end: the same exit code, or death by the same signal. Signals the
kubelet sends to the group reach COMMAND and its children directly; the shim
itself lets them pass (it exits with COMMAND). When the kubelet's thread or
process dies, the kernel sends the shim :data:`DEATH_SIGNAL` (its parent-death
signal) and the shim kills the whole group, grandchildren included, which a
parent-death signal on COMMAND alone could not do.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: A real-time signal nobody else sends, so its arrival means "the kubelet is gone".
DEATH_SIGNAL = signal.SIGRTMIN + 2
_PR_SET_PDEATHSIG = 1


def _kill_group(signum: int, frame: object) -> None:
    os.killpg(0, signal.SIGKILL)


def main() -> None:
    if len(sys.argv) < 3:
        sys.stderr.write("usage: shim.py KUBELET_PID COMMAND [ARGS...]\n")
        sys.exit(2)
    kubelet, argv = int(sys.argv[1]), sys.argv[2:]
    signal.signal(DEATH_SIGNAL, _kill_group)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0)
    if os.getppid() != kubelet:
        _kill_group(DEATH_SIGNAL, None)  # the kubelet died before the signal was armed
    # The group's SIGTERM/SIGINT are for COMMAND; the shim waits for COMMAND's answer.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    try:
        # Handlers (not SIG_IGN) are reset to the default by exec: COMMAND starts clean.
        child = os.posix_spawnp(argv[0], argv, os.environ)
    except OSError as exc:
        sys.stderr.write(f"cannot run {argv[0]!r}: {exc.strerror or exc}\n")
        sys.exit(127)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot be handled, so are never set
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)  # die the same way, so the kubelet sees the signal
        sys.exit(128 + sig)  # a signal whose default is not to terminate
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
