"""Termination signals in the launching process become a ``SignalException``.

The launcher (the agent) must not just die on SIGTERM: it has to stop its ranks with
the same signal first. ``install_signal_handlers`` makes SIGTERM, SIGINT, SIGHUP and
SIGQUIT raise :class:`SignalException` in the main thread, where the caller catches it
and calls ``PContext.close(death_sig=e.sigval)``.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["TERMINATION_SIGNALS", "SignalException", "install_signal_handlers", "restore_signal_handlers"]

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


def _raise_signal_exception(signum: int, frame: FrameType | None) -> None:
    sigval = signal.Signals(signum)
    raise SignalException(f"process received signal {sigval.name}", sigval=sigval)


def install_signal_handlers() -> dict[signal.Signals, Any] | None:
    """Make the termination signals raise ``SignalException``; return the previous handlers.

    Python delivers signals only to the main thread, so from any other thread this does
    nothing and returns ``None``. Pass the returned mapping to
    :func:`restore_signal_handlers` to undo.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    previous: dict[signal.Signals, Any] = {}
    for sig in TERMINATION_SIGNALS:
        previous[sig] = signal.signal(sig, _raise_signal_exception)
    return previous


def restore_signal_handlers(previous: dict[signal.Signals, Any] | None) -> None:
    """Put back handlers returned by :func:`install_signal_handlers` (only those still ours)."""
    if not previous or threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in previous.items():
        if signal.getsignal(sig) is _raise_signal_exception and handler is not None:
            signal.signal(sig, handler)
