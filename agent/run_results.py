"""What the agent's monitor concludes from what it observed of its workers (pure).

Each function turns one observation, keyed by local rank, into the :class:`RunResult` the
agent's loop acts on, keyed by global rank (``global_ranks``: local rank → global rank of
the current group): processes that ended, kept workers whose training raised and parked
(:mod:`kelastic.agent.keep`), ranks judged hung (:mod:`kelastic.agent.hang`).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping

from kelastic.agent.api import RunResult, WorkerState
from kelastic.agent.hang import HangVerdict
from kelastic.agent.multiprocessing import ProcessFailure, RunProcsResult

__all__ = ["ended", "hung", "parked"]


def ended(result: RunProcsResult, global_ranks: Mapping[int, int]) -> RunResult:
    """Every worker process ended (or returned, for callables): FAILED naming each failed
    rank, else SUCCEEDED with each rank's return value."""
    if result.is_failed():
        failures = {global_ranks[lr]: f for lr, f in result.failures.items()}
        return RunResult(state=WorkerState.FAILED, failures=failures)
    values = {global_ranks[lr]: v for lr, v in result.return_values.items()}
    return RunResult(state=WorkerState.SUCCEEDED, return_values=values)


def parked(failures: Mapping[int, tuple[int, str]], global_ranks: Mapping[int, int]) -> RunResult:
    """Kept workers whose training raised (local rank → (pid, why)): FAILED, each rank's
    failure an exit code of 1 with the exception's reason; the processes themselves live on."""
    return RunResult(
        state=WorkerState.FAILED,
        failures={
            global_ranks[lr]: ProcessFailure(local_rank=lr, pid=pid, exitcode=1, error_file="", message=why)
            for lr, (pid, why) in failures.items()
        },
    )


def hung(
    verdict: HangVerdict, global_ranks: Mapping[int, int], pids: Mapping[int, int], message: str
) -> RunResult:
    """Ranks judged hung: FAILED, each with the exit code that stopping it (SIGTERM) gives
    and ``message`` as its error, timed at the verdict."""
    return RunResult(
        state=WorkerState.FAILED,
        failures={
            global_ranks[lr]: ProcessFailure(
                local_rank=lr,
                pid=int(pids.get(lr, 0) or 0),
                exitcode=-int(signal.SIGTERM),
                error_file="",
                error_file_data={"message": message, "timestamp": verdict.at},
            )
            for lr in verdict.local_ranks
        },
    )
