"""An agent is always stoppable and never silent, whatever it waits on.

Real ``python -m kelastic.agent`` processes waiting on: no store at the endpoint, a socket
that accepts connections but never answers, and a store where the peers never come. Each
says what it waits for while it waits; SIGTERM (143) and SIGINT (130) end it with one line
naming that wait, without a traceback; ``join_timeout`` ends it naming the endpoint (and,
for a store it could not reach, the command that starts one).
"""

from __future__ import annotations

import logging
import os
import runpy
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent import waiting
from kelastic.agent.multiprocessing import SignalException, install_signal_handlers, restore_signal_handlers
from kelastic.agent.rendezvous.dial import Reach, probe
from kelastic.agent.rendezvous.server import ServerProcess

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))

#: Generous: the agent imports torch first, on a machine other tests share.
START = 120.0
#: How long a stopped agent may take to end here; its own bound is a second, but this
#: machine is shared (the old agent ignored signals for join_timeout, 600 s here).
STOPPED = 30.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_socket() -> Iterator[str]:
    """An endpoint that accepts connections (the kernel's backlog) and never answers."""
    host = harness.loopback_host()
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen(64)
    try:
        yield f"{host}:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _start(tmp_path: Path, endpoint: str, name: str, nnodes: str, join_timeout: int) -> Any:
    cluster = harness.Cluster(tmp_path / name, endpoint, run_id=f"waits-{name}-{tmp_path.name}")
    conf = f"join_timeout={join_timeout}"
    cluster.start(name, ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-conf", conf])
    return cluster


def _stopped_and_said(tmp_path: Path, endpoint: str, nnodes: str, waits_for: str, also: str = "") -> None:
    """Three agents wait: SIGTERM ends one (143), SIGINT another (130), join_timeout the third (1)."""
    term = _start(tmp_path, endpoint, "term", nnodes, 600)
    intr = _start(tmp_path, endpoint, "intr", nnodes, 600)
    late = _start(tmp_path, endpoint, "late", nnodes, 8)
    clusters = (term, intr, late)
    try:
        for c in clusters:
            c.wait_for(
                f"'waiting for {waits_for}'",
                lambda c=c: f"waiting for {waits_for}" in c.agents[0].output(),
                START,
            )
        term.agents[0].proc.send_signal(signal.SIGTERM)
        intr.agents[0].proc.send_signal(signal.SIGINT)
        assert term.agents[0].wait(STOPPED) == 128 + signal.SIGTERM
        assert intr.agents[0].wait(STOPPED) == 128 + signal.SIGINT
        assert late.agents[0].wait(START) == 1
        for c, sig in ((term, "SIGTERM"), (intr, "SIGINT")):
            out = c.agents[0].output()
            stopped = [line for line in out.splitlines() if f"stopped by {sig}" in line]
            assert len(stopped) == 1 and f"while waiting for {waits_for}" in stopped[0], out[-3000:]
        for c in clusters:
            out = c.agents[0].output()
            # A wait's progress line fits a terminal, as every INFO line of the agent does.
            long = [line for line in out.splitlines() if line.startswith("[I ") and len(line) > 100]
            assert not long, long
            assert "Traceback" not in out and "Logging error" not in out, out[-3000:]
            assert "TCPStore.cpp" not in out, out[-3000:]  # torch's own retries say nothing
        out = late.agents[0].output()
        assert endpoint in out and "join_timeout=8" in out and also in out, out[-3000:]
    finally:
        for c in clusters:
            c.close()


@pytest.mark.slow
def test_no_store_says_so_and_stops_on_a_signal(tmp_path: Path) -> None:
    host = harness.loopback_host()
    endpoint = f"{host}:{_free_port(host)}"
    port = endpoint.rpartition(":")[2]
    _stopped_and_said(
        tmp_path,
        endpoint,
        "2",
        f"the rendezvous store at {endpoint}: connection refused",
        also=f"`kelastic-rendezvous --host {host} --port {port}`",
    )


@pytest.mark.slow
def test_a_store_that_accepts_but_never_answers_says_so_and_stops_on_a_signal(
    tmp_path: Path, silent_socket: str
) -> None:
    host, _, port = silent_socket.rpartition(":")
    _stopped_and_said(
        tmp_path,
        silent_socket,
        "2",
        f"the rendezvous store at {silent_socket}: accepts",
        also=f"`kelastic-rendezvous --host {host} --port {port}`",
    )


@pytest.mark.slow
def test_a_peer_that_never_comes_is_counted_and_the_wait_stops_on_a_signal(
    tmp_path: Path, store: ServerProcess
) -> None:
    _stopped_and_said(tmp_path, store.endpoint, "2:4", "peers: 1 of at least 2 joined", also="round 1")


# -- the parts, in process -------------------------------------------------------------------------


def test_a_probe_tells_refused_from_accepting(silent_socket: str) -> None:
    host, _, port = silent_socket.rpartition(":")
    assert probe(host, int(port), 5.0)[0] is Reach.ACCEPTS
    closed = _free_port(host)
    assert probe(host, closed, 5.0)[0] is Reach.REFUSED


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_says_nothing_for_five_seconds_then_every_thirty(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = _Clock()
    wait = waiting.Wait("the thing", logging.getLogger("t"), clock)
    said: list[float] = []
    for t in range(0, 100):
        clock.now = 100.0 + t
        if wait.tell(lambda: f"the thing at {clock.now - 100:.0f}"):
            said.append(clock.now - 100)
    assert said == [5, 35, 65, 95]
    assert [r.getMessage() for r in caplog.records][:2] == [
        "waiting for the thing at 5 (5 s)",
        "waiting for the thing at 35 (35 s)",
    ]
    assert waiting.next_notice(0.0, None) == waiting.FIRST_NOTICE
    assert waiting.next_notice(0.0, 7.0) == 7.0 + waiting.NOTICE_EVERY


def test_the_exception_that_ended_a_wait_names_the_innermost_wait() -> None:
    log = logging.getLogger("t")
    error = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt), waiting.Wait("outer", log), waiting.Wait("inner", log) as inner:
        inner.update("inner, updated")
        raise error
    assert waiting.ended_by(error) == "inner, updated"
    assert waiting.ended_by(KeyboardInterrupt()) is None
    with waiting.Wait("done", log):
        pass
    assert waiting.ended_by(error) == "inner, updated"


def test_a_signal_that_interrupts_a_log_call_is_not_swallowed() -> None:
    """Raised inside ``logging`` the exception would be printed as a logging error and lost:
    the signal is sent again a moment later, and raises then."""
    previous = install_signal_handlers()
    log = logging.getLogger("kelastic-test-signal-in-log")

    class Kill(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs here, inside the log call

    handler = Kill()
    log.addHandler(handler)
    log.propagate = False
    try:
        with pytest.raises(SignalException):
            log.warning("stop")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        log.removeHandler(handler)
        restore_signal_handlers(previous)
