"""A re-form's stop off its critical path (kelastic.agent.reform): the old workers stop while the
agent joins the next round, and the new ones start only once the old ones are gone."""

from __future__ import annotations

import runpy
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousInfo

from kelastic.agent.api import RunResult, SimpleElasticAgent, WorkerGroup, WorkerSpec, WorkerState
from kelastic.agent.events import MemorySink
from kelastic.agent.multiprocessing import ProcessFailure
from kelastic.agent.reform import STOP_BEFORE_JOIN_ENV, OverlappedStop, overlap_enabled

# -- the stop itself -------------------------------------------------------------------------


def test_the_stop_runs_beside_the_caller_and_wait_reports_it_once() -> None:
    release, stopped_on = threading.Event(), []
    done: list[tuple[float, float]] = []

    def stop() -> None:
        stopped_on.append(threading.current_thread().name)
        assert release.wait(10), "the test never released the stop"

    stopping = OverlappedStop(stop, lambda *told: done.append(told), overlap=True)
    assert stopping.overlapped and not done  # still stopping: the caller goes on meanwhile
    release.set()
    stopping.wait()
    stopping.wait()
    assert stopped_on == ["kelastic-stop-workers"]
    assert len(done) == 1 and done[0][0] >= 0 and done[0][1] > 1e9  # seconds, then wall clock


def test_a_failed_stop_raises_on_the_waiting_thread_once() -> None:
    def stop() -> None:
        raise RuntimeError("could not stop the workers")

    stopping = OverlappedStop(stop, lambda *_: None, overlap=True)
    with pytest.raises(RuntimeError, match="could not stop"):
        stopping.wait()
    stopping.wait()  # told once


def test_opted_out_the_stop_is_over_before_the_constructor_returns() -> None:
    ran: list[str] = []
    stopping = OverlappedStop(
        lambda: ran.append(threading.current_thread().name), lambda *_: None, overlap=False
    )
    assert ran == [threading.current_thread().name] and not stopping.overlapped


@pytest.mark.parametrize(
    ("value", "overlap"),
    [(None, True), ("", True), ("0", True), ("1", False), ("true", False), ("YES", False)],
)
def test_the_environment_opts_out(value: str | None, overlap: bool) -> None:
    env = {} if value is None else {STOP_BEFORE_JOIN_ENV: value}
    assert overlap_enabled(env) is overlap


# -- in the agent ----------------------------------------------------------------------------


#: A real single-node rendezvous over a real TCPStore (test_agent_api.py's).
OneNodeHandler: Any = runpy.run_path(str(Path(__file__).with_name("test_agent_api.py")))["OneNodeHandler"]


class Handler(OneNodeHandler):  # type: ignore[misc]
    """The one-node rendezvous, noting each join in ``order``."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def next_rendezvous(self) -> RendezvousInfo:
        self.order.append("join")
        return super().next_rendezvous()  # type: ignore[no-any-return]


class Agent(SimpleElasticAgent):
    """Workers that fail once, then succeed; the stop takes until the next join has begun."""

    def __init__(self, handler: Handler) -> None:
        spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=handler, entrypoint="python")
        super().__init__(spec, exit_barrier_timeout=5, membership_grace=0.01, event_sink=MemorySink())
        self.handler = handler
        self.states = [WorkerState.FAILED, WorkerState.SUCCEEDED]
        self.order = handler.order

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.order.append("start")
        return {0: 4242}

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # A slow stop: over once this node joined again (opted out, on the agent's thread: at once).
        overlapped = threading.current_thread() is not threading.main_thread()
        waited = 0
        while overlapped and self.handler.rounds < 2:
            waited += 1
            assert waited < 1000, "the agent did not join the next round while its workers stopped"
            threading.Event().wait(0.01)
        self.order.append("stopped")

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        state = self.states.pop(0)
        if state == WorkerState.FAILED:
            return RunResult(state, failures={0: ProcessFailure(0, 4242, 1, "")})
        return RunResult(state)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM) -> None:
        pass


def _names(agent: Agent) -> list[str]:
    sink = agent._event_sink
    assert isinstance(sink, MemorySink)
    return sink.names()


def test_the_agent_joins_while_its_old_workers_stop_and_starts_new_ones_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(STOP_BEFORE_JOIN_ENV, raising=False)
    handler = Handler()
    agent = Agent(handler)
    assert agent.run().state == WorkerState.SUCCEEDED
    assert handler.order == ["join", "start", "join", "stopped", "start"]
    names = _names(agent)
    for name in ("fault_noticed", "restart", "workers_stopped", "rendezvous", "workers_started"):
        assert f"kelastic.agent.{name}" in names, names
    # The stop is reported before the ranks of the new round: the group waits for it there.
    assert names.index("kelastic.agent.workers_stopped") < len(names) - 1 - names[::-1].index(
        "kelastic.agent.rendezvous"
    )


def test_opted_out_the_agent_stops_its_workers_before_it_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STOP_BEFORE_JOIN_ENV, "1")
    handler = Handler()
    agent = Agent(handler)
    assert agent.run().state == WorkerState.SUCCEEDED
    assert handler.order == ["join", "start", "stopped", "join", "start"]
