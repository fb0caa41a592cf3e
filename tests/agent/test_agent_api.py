"""The agent's pure rank assignment, its store I/O, spec validation and the monitor-loop decisions."""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from kelastic.agent import api, warm
from kelastic.agent.api import (
    LossWatcher,
    MembershipChangedError,
    MembershipWatcher,
    RankAssignment,
    RoleInstanceInfo,
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
    assign_ranks,
    exchange_rank_assignments,
    exit_barrier,
)
from kelastic.agent.events import MemorySink
from kelastic.agent.multiprocessing import ProcessFailure, SignalException


def _store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


class OneNodeHandler(RendezvousHandler):
    """A real single-node rendezvous over a real TCPStore; membership changes are scripted by the test."""

    def __init__(self, changes: list[bool] | None = None) -> None:
        self.store = _store()
        self.rounds = 0
        self.changes = list(changes or [])
        self.shutdowns = 0

    def get_backend(self) -> str:
        return "test"

    def next_rendezvous(self) -> RendezvousInfo:
        self.rounds += 1
        from torch.distributed import PrefixStore

        store = PrefixStore(f"round{self.rounds}", self.store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo("127.0.0.1", 29999))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "run-test"

    def shutdown(self) -> bool:
        self.shutdowns += 1
        return True

    # kelastic's extension: membership watching
    def membership_changed(self) -> bool:
        return False

    def wait_membership_change(self, timeout: float) -> bool:
        return self.changes.pop(0) if self.changes else False


def test_membership_watching_is_a_capability_the_handler_declares() -> None:
    """The agent asks through MembershipWatcher, not by probing attributes: kelastic's handler
    (and this module's test handler) have it, torch's own handlers do not."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from kelastic.agent.rendezvous.handler import KelasticRendezvousHandler

    assert issubclass(KelasticRendezvousHandler, MembershipWatcher)
    assert isinstance(OneNodeHandler(), MembershipWatcher)
    assert not issubclass(DynamicRendezvousHandler, MembershipWatcher)
    assert not issubclass(StaticTCPRendezvous, MembershipWatcher)


class ScriptedAgent(SimpleElasticAgent):
    """Workers whose states follow a script: exercises the loop's decisions, not processes."""

    def __init__(self, spec: WorkerSpec, states: list[Any], **kw: Any) -> None:
        super().__init__(spec, exit_barrier_timeout=5, membership_grace=0.01, event_sink=MemorySink(), **kw)
        self.states = list(states)
        self.starts: list[int] = []
        self.shutdown_signals: list[signal.Signals] = []

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.starts.append(self.restart_count)
        return {w.local_rank: 1000 + w.local_rank for w in worker_group.workers}

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        pass

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        state = self.states.pop(0)
        if isinstance(state, BaseException):
            raise state
        if state == WorkerState.FAILED:
            return RunResult(state, failures={0: ProcessFailure(0, 1000, 1, "")})
        return RunResult(state)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM) -> None:
        self.shutdown_signals.append(death_sig)


class SimpleScriptedAgent(ScriptedAgent):
    """A scripted agent with the default membership grace (the handler's)."""

    def __init__(self, spec: WorkerSpec, states: list[Any]) -> None:
        SimpleElasticAgent.__init__(self, spec, exit_barrier_timeout=5, event_sink=MemorySink())
        self.states = list(states)
        self.starts = []
        self.shutdown_signals = []


def _spec(handler: RendezvousHandler, **kw: Any) -> WorkerSpec:
    return WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=handler, entrypoint="python", **kw)


def test_homogeneous_ranks_are_offsets_by_group_rank() -> None:
    got = assign_ranks([RoleInstanceInfo("w", r, 2) for r in (2, 0, 1)])
    assert got == {
        0: RankAssignment(0, 6, 0, 6),
        1: RankAssignment(2, 6, 2, 6),
        2: RankAssignment(4, 6, 4, 6),
    }


def test_heterogeneous_ranks_and_role_ranks() -> None:
    infos = [
        RoleInstanceInfo("trainer", 0, 2),
        RoleInstanceInfo("ps", 1, 1),
        RoleInstanceInfo("trainer", 2, 3),
    ]
    got = assign_ranks(infos)
    assert [got[r].base_global_rank for r in range(3)] == [0, 2, 3]
    assert {a.global_world_size for a in got.values()} == {6}
    assert (got[1].base_role_rank, got[1].role_world_size) == (0, 1)
    assert (got[0].base_role_rank, got[0].role_world_size) == (0, 5)
    assert (got[2].base_role_rank, got[2].role_world_size) == (2, 5)


def test_the_group_restart_count_is_the_most_any_agent_spent() -> None:
    got = assign_ranks([RoleInstanceInfo("w", 0, 1, restarts=0), RoleInstanceInfo("w", 1, 1, restarts=2)])
    assert {a.group_restart_count for a in got.values()} == {2}
    info = RoleInstanceInfo("w", 1, 3, restarts=2)
    assert RoleInstanceInfo.from_json(info.to_json()) == info
    assert RankAssignment.from_json(got[1].to_json()) == got[1]
    # an agent of an earlier release sends and reads the shorter forms
    assert RoleInstanceInfo.from_json('["w", 1, 3]') == RoleInstanceInfo("w", 1, 3, 0)
    assert RankAssignment.from_json("[0, 2, 0, 2]") == RankAssignment(0, 2, 0, 2, 0)


def test_ranks_need_contiguous_group_ranks() -> None:
    with pytest.raises(ValueError, match=r"group ranks 0\.\.1"):
        assign_ranks([RoleInstanceInfo("w", 0, 1), RoleInstanceInfo("w", 2, 1)])


def test_exchange_over_a_real_store() -> None:
    server = _store()
    sizes = {0: 1, 1: 3, 2: 2}
    out: dict[int, RankAssignment] = {}

    def agent(rank: int) -> None:
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
        out[rank] = exchange_rank_assignments(client, rank, 3, "w", sizes[rank], timeout=10)

    threads = [threading.Thread(target=agent, args=(r,)) for r in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert [out[r].base_global_rank for r in range(3)] == [0, 1, 4]
    assert {a.global_world_size for a in out.values()} == {6}


def test_exchange_names_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match="rank assignment from group rank 0"):
        exchange_rank_assignments(_store(), 1, 2, "w", 1, timeout=0.3)


def test_exchange_gives_up_when_the_membership_changes() -> None:
    start = time.monotonic()
    with pytest.raises(MembershipChangedError, match="rank assignment from group rank 0"):
        exchange_rank_assignments(_store(), 1, 2, "w", 1, timeout=30, abort=lambda: True)
    assert time.monotonic() - start < 5


def test_exit_barrier_releases_all_and_times_out_alone() -> None:
    server = _store()
    results: list[bool] = []

    def agent() -> None:  # one client per agent, as in real life
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
        results.append(exit_barrier(client, 2, 5))

    threads = [threading.Thread(target=agent) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [True, True]
    assert exit_barrier(_store(), 2, 0.2) is False


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"role": ""}, "role"),
        ({"local_world_size": 0}, "local_world_size"),
        ({"local_world_size": "2"}, "local_world_size"),
        ({"entrypoint": None}, "entrypoint"),
        ({"entrypoint": 3}, "entrypoint"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"monitor_interval": 0}, "monitor_interval"),
        ({"master_port": 70000}, "master_port"),
        ({"rdzv_handler": object()}, "rdzv_handler"),  # None is accepted, as torch does
        ({"numa_options": object()}, "numa_options"),
    ],
)
def test_spec_validation_names_the_field(kw: dict[str, Any], needle: str) -> None:
    base: dict[str, Any] = {
        "role": "w",
        "local_world_size": 1,
        "rdzv_handler": OneNodeHandler(),
        "entrypoint": "python",
    }
    base.update(kw)
    with pytest.raises(ValueError, match=needle):
        WorkerSpec(**base)


def test_entrypoint_names() -> None:
    handler = OneNodeHandler()
    assert _spec(handler).get_entrypoint_name() == "python"
    spec = WorkerSpec(
        role="w", local_world_size=1, rdzv_handler=handler, entrypoint=warm.run_script, args=("/a/t.py",)
    )
    assert spec.get_entrypoint_name() == "t.py"
    assert (
        WorkerSpec(role="w", local_world_size=1, rdzv_handler=handler, entrypoint=print).get_entrypoint_name()
        == "print"
    )


def test_is_running() -> None:
    running = {s for s in WorkerState if WorkerState.is_running(s)}
    assert running == {WorkerState.HEALTHY, WorkerState.UNHEALTHY}


def test_failures_spend_restarts_until_exhausted() -> None:
    H, F = WorkerState.HEALTHY, WorkerState.FAILED
    agent = ScriptedAgent(_spec(OneNodeHandler(), max_restarts=1), [H, F, H, F])
    result = agent.run()
    assert result.is_failed() and 0 in result.failures
    assert agent.starts == [0, 1]  # TORCHELASTIC_RESTART_COUNT seen by each start
    assert agent.restart_count == 1


def test_membership_change_restarts_without_spending() -> None:
    H, S = WorkerState.HEALTHY, WorkerState.SUCCEEDED
    handler = OneNodeHandler(changes=[False, True, False])
    agent = ScriptedAgent(_spec(handler, max_restarts=0), [H, H, S])
    result = agent.run()
    assert result.state == S
    assert agent.starts == [0, 0]
    assert handler.rounds == 2
    assert agent.metrics.counters()["agent.membership_restarts"] == 1


def test_failure_during_membership_change_is_free() -> None:
    F, S = WorkerState.FAILED, WorkerState.SUCCEEDED
    handler = OneNodeHandler(changes=[True, False])
    agent = ScriptedAgent(_spec(handler, max_restarts=0), [F, S])
    assert agent.run().state == S
    assert agent.starts == [0, 0]


class PeerHandler(OneNodeHandler):
    """Rank 0 of two; the peer is scripted: its role info (with the restarts it spent) is in
    every round's store, and ``losses`` answers whether a member was lost after a failure."""

    def __init__(
        self, losses: list[bool], peer_restarts: int = 0, previous_losses: list[bool] | None = None, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.losses = list(losses)
        self.previous_losses = list(previous_losses or [])
        self.peer_restarts = peer_restarts
        self.asked: list[tuple[str, float]] = []

    def next_rendezvous(self) -> RendezvousInfo:
        from torch.distributed import PrefixStore

        self.rounds += 1
        store = PrefixStore(f"round{self.rounds}", self.store)
        peer = RoleInstanceInfo("trainer", 1, 2, restarts=self.peer_restarts)
        store.set(f"{api._ROLE_INFO_PREFIX}1", peer.to_json())
        # The peer is at the exit barrier already: a round that succeeds ends without waiting
        # out the barrier's timeout for a peer that does not run (torch's barrier counts
        # its members under <key>/num_members).
        store.add(f"{api._TERMINAL_STATE_SYNC_ID}/num_members", 1)
        return RendezvousInfo(store, 0, 2, RendezvousStoreInfo("127.0.0.1", 29999))

    def wait_member_lost(self, timeout: float) -> bool:
        self.asked.append(("member_lost", timeout))
        return self.losses.pop(0)

    def wait_previous_round_lost(self, timeout: float) -> bool:
        self.asked.append(("previous_round_lost", timeout))
        return self.previous_losses.pop(0)

    def announce_leaving(self) -> None:
        self.announced = True

    @property
    def loss_notice(self) -> float:
        return 1.5


def test_a_failure_without_a_lost_member_spends_a_restart_though_the_round_changed() -> None:
    """The peer re-joined (the round changed) because its workers failed in the same
    collective: that is the group's own failure, and it costs a restart here too."""
    F, S = WorkerState.FAILED, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False], previous_losses=[False], changes=[True, False])
    assert isinstance(handler, LossWatcher)
    agent = ScriptedAgent(_spec(handler, max_restarts=1), [F, S])
    assert agent.run().state == S
    assert agent.starts == [0, 1] and agent.restarts_spent == 1


def test_a_failure_restarts_at_once_without_waiting_for_the_verdict() -> None:
    """A crash's verdict (no member lost) comes from the peers re-joining, which they do
    only once they restart: the agent asks what is known now (no wait), restarts, and
    asks about the round it left after re-joining, within what is left of the grace."""
    F, S = WorkerState.FAILED, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False], previous_losses=[False])
    agent = SimpleScriptedAgent(_spec(handler, max_restarts=1), [F, S])
    assert agent.run().state == S
    assert [q for q, _ in handler.asked] == ["member_lost", "previous_round_lost"]
    assert handler.asked[0][1] == 0.0
    assert 1.0 < handler.asked[1][1] <= 1.5, "the rest of the handler's loss_notice"
    assert agent.restarts_spent == 1


def test_a_failure_with_a_lost_member_is_free() -> None:
    F, S = WorkerState.FAILED, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[True])
    agent = SimpleScriptedAgent(_spec(handler, max_restarts=1), [F, S])
    assert agent.run().state == S
    assert agent.starts == [0, 0] and agent.metrics.counters()["agent.membership_restarts"] == 1
    assert agent.restarts_spent == 0
    assert handler.asked == [("member_lost", 0.0)], "a loss known at once settles it"


def test_a_loss_seen_after_the_restart_gives_the_restart_back() -> None:
    """The peer's death showed only after this agent restarted: the restart it spent is
    given back before the round's restart counts are exchanged, so the workers start
    with the count of before."""
    F, S = WorkerState.FAILED, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False], previous_losses=[True])
    agent = SimpleScriptedAgent(_spec(handler, max_restarts=1), [F, S])
    assert agent.run().state == S
    assert agent.starts == [0, 0] and agent.restarts_spent == 0
    counters = agent.metrics.counters()
    assert counters["agent.restarts"] == 0 and counters["agent.membership_restarts"] == 1


def test_a_failure_that_would_end_the_job_waits_for_the_heartbeat_timeout() -> None:
    """With no restart left a late-seen loss would cost the whole job: wait as long as the
    slowest detection (the heartbeat timeout), not just the peer link's."""
    F, S = WorkerState.FAILED, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False, True], previous_losses=[False])
    handler.settings = SimpleNamespace(node_timeout=5.0, keep_alive_interval=1.0)  # type: ignore[attr-defined]
    agent = SimpleScriptedAgent(_spec(handler, max_restarts=1), [F, F, S])
    assert agent.run().state == S
    assert handler.asked[-1] == ("member_lost", 6.0)  # the second failure came with no restart left
    assert agent.starts == [0, 1, 1]


def test_a_signal_announces_leaving_before_the_workers_stop() -> None:
    handler = PeerHandler(losses=[])
    agent = ScriptedAgent(_spec(handler), [SignalException("stop", sigval=signal.SIGTERM)])
    with pytest.raises(SignalException):
        agent.run()
    assert getattr(handler, "announced", False) and agent.shutdown_signals == [signal.SIGTERM]
    assert agent._leave_once_stopped, "the shutdown leaves the round once the workers stopped"


def test_after_a_signal_the_node_leaves_its_round_once_its_workers_stopped_not_at_the_end(
    tmp_path: Any,
) -> None:
    """A pod deleted: the survivors re-form once its workers are gone, not after its spares,
    logs and last progress (the launcher's leave afterwards finds nothing to do)."""
    from kelastic.agent.local_agent import LocalElasticAgent

    order: list[str] = []
    handler = PeerHandler(losses=[])
    handler.shutdown = lambda: order.append("left") or True  # type: ignore[method-assign]
    agent = LocalElasticAgent(_spec(handler), log_dir=tmp_path, event_sink=MemorySink(), progress=False)
    agent._close_workers = lambda sig: order.append(f"workers {sig.name}")  # type: ignore[method-assign]
    agent._spares.close = lambda: order.append("spares")  # type: ignore[method-assign]
    agent._shutdown(signal.SIGTERM)
    assert order == ["workers SIGTERM", "spares"], "no signal: the launcher leaves (or closes the job)"
    order.clear()
    agent._leave_once_stopped = True  # what run() sets on a signal
    agent._shutdown(signal.SIGTERM)
    assert order == ["workers SIGTERM", "left", "spares"]


def test_workers_get_the_groups_restart_count() -> None:
    """A spared agent (or one that joined late) starts its workers with the count of the
    agent that spent the most, so that every rank of the attempt agrees."""
    agent = ScriptedAgent(
        _spec(PeerHandler(losses=[], peer_restarts=2), max_restarts=3), [WorkerState.SUCCEEDED]
    )
    agent.run()
    assert agent.starts == [2]
    assert agent.restarts_spent == 0 and agent.restart_count == 2


def test_signal_stops_workers_with_the_same_signal() -> None:
    agent = ScriptedAgent(_spec(OneNodeHandler()), [SignalException("stop", sigval=signal.SIGHUP)])
    with pytest.raises(SignalException):
        agent.run()
    assert agent.shutdown_signals == [signal.SIGHUP]


def test_events_are_recorded() -> None:
    agent = ScriptedAgent(_spec(OneNodeHandler()), [WorkerState.SUCCEEDED])
    agent.run()
    names = agent._event_sink.names()  # type: ignore[attr-defined]
    assert names[0] == "kelastic.agent.rendezvous"
    assert "kelastic.agent.workers_started" in names
    assert names.count("kelastic.worker.SUCCEEDED") == 2
    assert names[-1] == "kelastic.agent.succeeded"


class Commits:
    """The checkpoint memory's pace as the loop sees it: commits land on scripted waits."""

    def __init__(self, cadence: tuple[int | None, float | None, float | None], lands: list[bool]) -> None:
        self._cadence = cadence
        self.lands = list(lands)
        self.waits: list[tuple[int, float]] = []

    def cadence(self) -> tuple[int | None, float | None, float | None]:
        return self._cadence

    def wait_committed(self, after: int, timeout: float) -> bool:
        self.waits.append((after, timeout))
        landed = self.lands.pop(0) if self.lands else False
        if not landed:
            time.sleep(timeout)
        return landed


def _restart_reasons(agent: SimpleElasticAgent) -> list[str]:
    sink = agent._event_sink
    return [e.metadata["reason"] for e in sink.events if e.name == "kelastic.agent.restart"]  # type: ignore[attr-defined]


def test_nodes_joining_a_group_that_saves_memory_checkpoints_wait_for_the_next_one() -> None:
    """Re-formed right after a checkpoint the grown group redoes no step; the workers
    keep training until it is committed."""
    H, S = WorkerState.HEALTHY, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False, False], changes=[True, True, False])
    commits = Commits(cadence=(5, 0.5, 2.0), lands=[False, True])
    agent = ScriptedAgent(_spec(handler, monitor_interval=0.05), [H, H, S], checkpoint_commits=commits)
    assert agent.run().state == S
    assert handler.rounds == 2, "one restart, after the commit"
    assert [after for after, _ in commits.waits] == [5, 5]
    assert _restart_reasons(agent) == ["rendezvous membership changed; at the checkpoint after 5"]
    assert agent.restarts_spent == 0


def test_a_member_lost_while_joiners_wait_for_a_checkpoint_restarts_at_once() -> None:
    H, S = WorkerState.HEALTHY, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False, True], changes=[True, True, False])
    commits = Commits(cadence=(5, 0.5, 2.0), lands=[False])
    agent = ScriptedAgent(_spec(handler, monitor_interval=0.05), [H, H, S], checkpoint_commits=commits)
    assert agent.run().state == S
    assert handler.rounds == 2 and len(commits.waits) == 1
    assert _restart_reasons(agent) == ["rendezvous membership changed"]


class RejoinHandler(PeerHandler):
    """The peer re-joins the next round (its workers failed) on the second look: the round is over."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.looks = 0

    def round_over(self) -> bool:
        self.looks += 1
        return self.looks >= 2 and self.rounds == 1


def test_a_member_that_rejoined_while_joiners_wait_for_a_checkpoint_restarts_at_once() -> None:
    """A crashed rank's agent re-joins at once: its round commits no checkpoint any more, so
    the others re-form without waiting for one (or for their workers to fail)."""
    H, S = WorkerState.HEALTHY, WorkerState.SUCCEEDED
    handler = RejoinHandler(losses=[False, False], changes=[True, True, False])
    commits = Commits(cadence=(5, 0.5, 2.0), lands=[False])
    agent = ScriptedAgent(_spec(handler, monitor_interval=0.05), [H, H, S], checkpoint_commits=commits)
    assert isinstance(handler, api.RoundWatcher)
    assert agent.run().state == S
    assert handler.rounds == 2 and len(commits.waits) == 1
    assert _restart_reasons(agent) == ["rendezvous membership changed"]


def test_joiners_wait_no_longer_than_the_deferral_when_no_checkpoint_comes() -> None:
    H, S = WorkerState.HEALTHY, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False] * 20, changes=[True] * 20)
    commits = Commits(cadence=(5, 0.0, 0.1), lands=[])  # within 0.15 s
    agent = ScriptedAgent(_spec(handler, monitor_interval=0.05), [H] * 10 + [S], checkpoint_commits=commits)
    started = time.monotonic()
    assert agent.run().state == S
    assert handler.rounds >= 2
    assert _restart_reasons(agent)[0] == "rendezvous membership changed; no checkpoint after 5 came in time"
    assert time.monotonic() - started < 5


def test_joiners_do_not_wait_when_the_job_saves_no_memory_checkpoint() -> None:
    H, S = WorkerState.HEALTHY, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False], changes=[True, False])
    commits = Commits(cadence=(None, None, None), lands=[])
    agent = ScriptedAgent(_spec(handler), [H, S], checkpoint_commits=commits)
    assert agent.run().state == S
    assert handler.rounds == 2 and commits.waits == []


def test_workers_failing_while_joiners_wait_for_a_checkpoint_restart_free() -> None:
    """A peer that re-formed first (its commit came earlier) stops the group's workers:
    their failure is the group re-forming, not a restart to spend."""
    H, F, S = WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False], changes=[True, False, False])
    commits = Commits(cadence=(5, 0.5, 2.0), lands=[False])
    agent = ScriptedAgent(
        _spec(handler, monitor_interval=0.05, max_restarts=0), [H, F, S], checkpoint_commits=commits
    )
    assert agent.run().state == S
    assert handler.rounds == 2 and agent.restarts_spent == 0


def test_workers_started_after_the_last_commit_count_the_pace_from_their_start() -> None:
    """After a restart the next save comes an interval after the workers' start, however
    long ago the last commit was: joiners still wait for it."""
    H, S = WorkerState.HEALTHY, WorkerState.SUCCEEDED
    handler = PeerHandler(losses=[False], changes=[True, False])
    commits = Commits(cadence=(5, 13.0, 6.0), lands=[True])  # 13 s > two intervals: stopped?
    agent = ScriptedAgent(_spec(handler, monitor_interval=0.05), [H, S], checkpoint_commits=commits)
    assert agent.run().state == S
    assert _restart_reasons(agent) == ["rendezvous membership changed; at the checkpoint after 5"]
