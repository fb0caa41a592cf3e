"""Termination signals in the launching process become a ``SignalException``.

The launcher (the agent) must not just die on SIGTERM: it has to stop its ranks with
the same signal first. ``install_signal_handlers`` makes SIGTERM, SIGINT, SIGHUP and
SIGQUIT raise :class:`SignalException` in the main thread, where the caller catches it
and calls ``PContext.close(death_sig=e.sigval)``. A signal that comes within two seconds
of the last one that raised is told on stderr and ignored, so that the clean-up the first
one started is not torn in the middle; one that interrupts a log call is sent again a
moment later (raised inside ``logging``, its exception would be swallowed).

``TORCHELASTIC_SIGNALS_TO_HANDLE`` (torch's variable: comma-separated names such as
``SIGTERM,SIGINT,SIGUSR1``) replaces that set; a name that is not a signal, or a signal
that cannot be handled (SIGKILL), is logged and skipped.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

__all__ = [
    "SIGNALS_ENV",
    "TERMINATION_SIGNALS",
    "SignalException",
    "install_signal_handlers",
    "restore_signal_handlers",
    "signals_to_handle",
]

logger = logging.getLogger(__name__)

#: Names the signals to turn into ``SignalException`` (torch's variable).
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"

TERMINATION_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
)


class SignalException(Exception):
    """Raised in the main thread when the launching process receives a termination signal."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


def signals_to_handle(value: str | None) -> tuple[tuple[signal.Signals, ...], list[str]]:
    """The signals named by ``value`` (``SIGNALS_ENV``'s syntax; None or blank: the default
    set), and the names that are not signals; pure."""
    if value is None or not value.strip():
        return TERMINATION_SIGNALS, []
    found: list[signal.Signals] = []
    unknown: list[str] = []
    for raw in value.split(","):
        name = raw.strip()
        if not name:
            continue
        sig = getattr(signal.Signals, name, None)
        if sig is None:
            unknown.append(name)
        elif sig not in found:
            found.append(sig)
    return tuple(found), unknown


# The signal whose SignalException the process is handling, and when it was raised (None:
# none yet). A second signal soon after must not raise into the clean-up the first one started
# (a rank half stopped); it is told and ignored. Later it raises again: the first one may have
# been swallowed by an ``except Exception`` it interrupted. Reset by install_signal_handlers.
_stopping: tuple[signal.Signals, float] | None = None
#: Seconds after a SignalException in which another termination signal is ignored.
_IGNORE_AGAIN_FOR = 2.0
#: A signal that interrupts a log call is sent again this much later (seconds): raised inside
#: ``logging``, the exception would be swallowed ("--- Logging error ---") and the signal lost.
_RESEND_AFTER = 0.05


def _in_logging(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("logging"):
            return True
        frame = frame.f_back
    return False


def _raise_signal_exception(signum: int, frame: FrameType | None) -> None:
    global _stopping
    sigval = signal.Signals(signum)
    if _in_logging(frame):
        threading.Timer(_RESEND_AFTER, os.kill, (os.getpid(), signum)).start()
        return
    if _stopping is not None and time.monotonic() - _stopping[1] < _IGNORE_AGAIN_FOR:
        # Not logging: the handler may have interrupted a log call of this very thread.
        os.write(2, f"already stopping on {_stopping[0].name}; ignoring {sigval.name}\n".encode())
        return
    _stopping = (sigval, time.monotonic())
    raise SignalException(f"process received signal {sigval.name}", sigval=sigval)


def install_signal_handlers() -> dict[signal.Signals, Any] | None:
    """Make the termination signals raise ``SignalException``; return the previous handlers.

    Python delivers signals only to the main thread, so from any other thread this does
    nothing and returns ``None``. Pass the returned mapping to
    :func:`restore_signal_handlers` to undo.
    """
    global _stopping
    if threading.current_thread() is not threading.main_thread():
        return None
    _stopping = None
    wanted, unknown = signals_to_handle(os.environ.get(SIGNALS_ENV))
    for name in unknown:
        logger.warning("%s names %r, which is not a signal; ignoring it", SIGNALS_ENV, name)
    previous: dict[signal.Signals, Any] = {}
    for sig in wanted:
        try:
            previous[sig] = signal.signal(sig, _raise_signal_exception)
        except (OSError, ValueError) as exc:  # SIGKILL/SIGSTOP cannot be caught
            logger.warning("cannot handle %s (%s); ignoring it", sig.name, exc)
    return previous


def restore_signal_handlers(previous: dict[signal.Signals, Any] | None) -> None:
    """Put back handlers returned by :func:`install_signal_handlers` (only those still ours)."""
    if not previous or threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in previous.items():
        if signal.getsignal(sig) is _raise_signal_exception and handler is not None:
            signal.signal(sig, handler)
