"""Redirect this process's stdout or stderr to a file, at the file-descriptor level.

``with redirect_stdout("out.log"): ...`` sends everything written to the descriptor under
``sys.stdout`` (fd 1 in a plain process: Python's ``print``, C extensions, subprocesses
started inside the block) to ``out.log``
(truncated first), and puts the previous stream back afterwards. The same names as
``torch.distributed.elastic.multiprocessing.redirects``: :func:`redirect`,
:func:`redirect_stdout`, :func:`redirect_stderr`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from functools import partial

__all__ = ["redirect", "redirect_stderr", "redirect_stdout"]

_FDS = {"stdout": 1, "stderr": 2}


def _flush_c_streams() -> None:
    """Flush C's stdio buffers too, so what C code wrote lands before the switch."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def redirect(std: str, to_file: str | os.PathLike[str]) -> Iterator[None]:
    """Redirect ``std`` (``"stdout"`` or ``"stderr"``) to ``to_file`` for the block."""
    if std not in _FDS:
        raise ValueError(f"std must be 'stdout' or 'stderr', got {std!r}")
    stream = getattr(sys, std)
    try:
        # The descriptor under Python's stream: fd 1/2 in a plain process, whatever a
        # test runner or wrapper put under sys.stdout otherwise (as torch does).
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = _FDS[std]
    stream.flush()
    _flush_c_streams()
    saved = os.dup(fd)
    try:
        target = os.open(to_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
        yield
    finally:
        getattr(sys, std).flush()
        _flush_c_streams()
        os.dup2(saved, fd)
        os.close(saved)


redirect_stdout = partial(redirect, "stdout")
redirect_stderr = partial(redirect, "stderr")
