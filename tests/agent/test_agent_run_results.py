"""The monitor's conclusions from what it saw of its workers (kelastic.agent.run_results):
each observation by local rank becomes a RunResult by global rank."""

from __future__ import annotations

import signal

from kelastic.agent import run_results
from kelastic.agent.api import WorkerState
from kelastic.agent.hang import HangVerdict
from kelastic.agent.multiprocessing import ProcessFailure, RunProcsResult

GLOBAL = {0: 4, 1: 5}  # this node's local ranks 0 and 1 are the group's ranks 4 and 5


def test_ended_processes_fail_by_global_rank_or_succeed_with_their_values() -> None:
    failure = ProcessFailure(local_rank=1, pid=77, exitcode=-9, error_file="")
    failed = run_results.ended(RunProcsResult(failures={1: failure}), GLOBAL)
    assert failed.state is WorkerState.FAILED and failed.failures == {5: failure}
    done = run_results.ended(RunProcsResult(return_values={0: "a", 1: None}), GLOBAL)
    assert done.state is WorkerState.SUCCEEDED and done.return_values == {4: "a", 5: None}
    assert not done.failures


def test_a_parked_failure_is_the_ranks_exception_with_exit_code_one() -> None:
    result = run_results.parked({0: (1234, "ValueError: bad batch")}, GLOBAL)
    assert result.state is WorkerState.FAILED and list(result.failures) == [4]
    f = result.failures[4]
    assert (f.local_rank, f.pid, f.exitcode) == (0, 1234, 1)
    assert "bad batch" in f.message


def test_hung_ranks_fail_as_their_stop_will_end_them_at_the_verdicts_time() -> None:
    verdict = HangVerdict(local_ranks=(0, 1), seconds=61.0, at=1_700_000_000.0)
    result = run_results.hung(verdict, GLOBAL, {0: 10, 1: 0}, "no progress for 61s")
    assert result.state is WorkerState.FAILED and sorted(result.failures) == [4, 5]
    f = result.failures[4]
    assert (f.pid, f.exitcode) == (10, -int(signal.SIGTERM))
    assert f.message == "no progress for 61s" and f.timestamp == 1_700_000_000
    assert result.failures[5].pid == 0  # a rank without a pid any more
