"""A signal handler's exception waits for the end of an uninterrupted section (a child started and recorded)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kelastic.localcluster.common.interrupts import interrupt, uninterrupted


class Stop(BaseException):
    pass


def test_outside_a_section_the_exception_is_raised_at_once() -> None:
    with pytest.raises(Stop):
        interrupt(Stop())


def test_inside_a_section_it_is_raised_at_the_end_of_the_outermost_one() -> None:
    steps: list[str] = []
    with pytest.raises(Stop), uninterrupted():
        with uninterrupted():
            interrupt(Stop())
            steps.append("inner went on")
        steps.append("outer went on")
    assert steps == ["inner went on", "outer went on"]
    with uninterrupted():  # nothing left over for the next section
        pass


def test_a_section_that_fails_raises_its_own_error_and_forgets_the_postponed_one() -> None:
    with pytest.raises(ValueError), uninterrupted():
        interrupt(Stop())
        raise ValueError("the section's own failure")
    with uninterrupted():
        pass


@pytest.fixture
def raising_sigterm() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: interrupt(Stop()))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_while_a_child_is_started_leaves_it_recorded(raising_sigterm: None) -> None:
    started: list[subprocess.Popen[bytes]] = []
    try:
        with pytest.raises(Stop), uninterrupted():
            # The signal arrives during the start, as Ctrl-C can; Popen runs the at-fork hooks.
            started.append(
                subprocess.Popen(
                    [sys.executable, "-c", "import time; time.sleep(60)"],
                    preexec_fn=lambda: None,
                )
            )
            os.kill(os.getpid(), signal.SIGTERM)
            started.append(subprocess.Popen([sys.executable, "-c", "pass"]))
        assert len(started) == 2  # both recorded: whoever stops things knows them
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
