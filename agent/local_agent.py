"""``LocalElasticAgent``: runs this node's workers as local processes via ``start_processes``.

Every worker gets torchrun's variables (:data:`kelastic.agent.contract.WORKER_ENV_VARS`,
``TORCHELASTIC_USE_AGENT_STORE`` and ``KELASTIC_PROGRESS_FILE``); when several
ranks share the node and ``OMP_NUM_THREADS`` is not set, it is set to 1 so the
ranks do not oversubscribe the CPUs.

Logs: ``<log_dir>/<run_id>/attempt_<n>/<local_rank>/`` where ``n`` counts every
start of the workers on this node (restarts after failures and after membership
changes alike), continuing after the attempts an earlier agent left in the same
directory, so no log is ever overwritten. Without ``log_dir`` a temporary
directory is used.

torch 2.x's arguments work too: ``LocalElasticAgent(spec, logs_specs, start_method,
exit_barrier_timeout, log_line_prefix_template)``. With ``logs_specs`` (a
:class:`~kelastic.agent.multiprocessing.LogsSpecs`, torch's own included) the logs go
where it says (for :class:`~kelastic.agent.multiprocessing.DefaultLogsSpecs`:
``<log_dir>/<run_id>_<random>/attempt_<restart count>/<local_rank>/``) and the spec's
``redirects``/``tee`` are not used; the progress files stay under the agent's own
directory. ``log_line_prefix_template`` is a :class:`string.Template` with ``${role_name}``,
``${rank}`` (global) and ``${local_rank}``, the header of each console line. The module's
``TORCHELASTIC_TIMER_FILE``, ``TORCHELASTIC_HEALTH_CHECK_PORT`` and
``TORCHELASTIC_ENABLE_FILE_TIMER`` are torch's variable names; kelastic has neither a
file-based watchdog timer nor a health-check server of torch's kind (its hang detection
is ``hang_timeout``, its health endpoint :mod:`kelastic.agent.health`), so it reads none
of them.

Warm start (``start_method="forkserver"``): the node joins its first rendezvous once
its fork server has imported what workers need (:func:`kelastic.agent.warm.wait_ready`),
so a node that is still warming up never holds a running group's workers stopped.

Progress: the agent owns the node's one progress display
(:mod:`kelastic.agent.progress`), pointed at the progress files of the current
attempt. With the kelastic rendezvous backend it also publishes the node's
progress (the slowest local rank's step) and its restart count to the rendezvous
store at every start of the workers and at most once per second while they run,
where the operator reads the job's progress and restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from string import Template
from typing import Any

from kelastic.agent import contract, handoff, hang, run_results, warm
from kelastic.agent.api import (
    CheckpointCommits,
    CheckpointRing,
    NamedNode,
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from kelastic.agent.checkpoint.errors import SecretMismatch
from kelastic.agent.events import EventSink
from kelastic.agent.goodput import GoodputLedger
from kelastic.agent.keep import Keeper, KeptWorkers
from kelastic.agent.metrics import Metrics
from kelastic.agent.multiprocessing import (
    LogsSpecs,
    PContext,
    Std,
    start_processes,
    to_std_map,
)
from kelastic.agent.progress import (
    NodeProgress,
    ProgressDisplay,
    ProgressReport,
    aggregate,
    progress_file,
    read_report,
)
from kelastic.agent.progress_publisher import ProgressPublisher
from kelastic.agent.reform import OverlappedStop
from kelastic.agent.spare import Spares, spares_enabled
from kelastic.agent.straggler import StragglerRule
from kelastic.agent.straggler_watch import StragglerWatch
from kelastic.agent.warm import prewarm_forkserver

__all__ = [
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_HEALTH_CHECK_PORT",
    "TORCHELASTIC_TIMER_FILE",
    "LocalElasticAgent",
    "worker_env",
]

#: torch's variable names (see the module docstring: kelastic reads none of them).
TORCHELASTIC_ENABLE_FILE_TIMER = "TORCHELASTIC_ENABLE_FILE_TIMER"
TORCHELASTIC_HEALTH_CHECK_PORT = "TORCHELASTIC_HEALTH_CHECK_PORT"
TORCHELASTIC_TIMER_FILE = "TORCHELASTIC_TIMER_FILE"

_log = logging.getLogger(__name__)

#: Seconds a node waits for its fork server's imports before joining the rendezvous anyway,
#: and between progress lines meanwhile.
WARM_WAIT = 300.0
WARM_PROGRESS_EVERY = 10.0
#: Seconds between progress lines while released workers have not exited yet.
EXIT_PROGRESS_EVERY = 30.0


def worker_env(
    spec: WorkerSpec,
    group: WorkerGroup,
    local_rank: int,
    *,
    restart_count: int,
    run_id: str,
    use_agent_store: bool,
    progress_file: str,
    base_env: Mapping[str, str],
) -> dict[str, str]:
    """The variables a worker gets on top of the agent's environment (pure).

    With ``spec.virtual_local_rank`` every worker gets ``LOCAL_RANK=0`` and
    ``CUDA_VISIBLE_DEVICES`` naming its own device: the ``local_rank``-th of the agent's
    ``CUDA_VISIBLE_DEVICES``, else ``local_rank`` (a ``ValueError`` when there are fewer).
    """
    worker = group.workers[local_rank]
    env = {
        "RANK": str(worker.global_rank),
        "GROUP_RANK": str(group.group_rank),
        "ROLE_RANK": str(worker.role_rank),
        "WORLD_SIZE": str(worker.world_size),
        "GROUP_WORLD_SIZE": str(group.group_world_size),
        "ROLE_WORLD_SIZE": str(worker.role_world_size),
        "MASTER_ADDR": str(group.master_addr),
        "MASTER_PORT": str(group.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    return env | local_env(spec, local_rank, run_id=run_id, progress_file=progress_file, base_env=base_env)


def local_env(
    spec: WorkerSpec, local_rank: int, *, run_id: str, progress_file: str, base_env: Mapping[str, str]
) -> dict[str, str]:
    """The part of :func:`worker_env` that does not depend on the group (pure): all that a
    worker started before its node has a group (a standby's) gets."""
    env = {
        "LOCAL_RANK": str(local_rank),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        contract.ENV_PROGRESS_FILE: progress_file,
    }
    if spec.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        visible = base_env.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
        else:
            devices = [d.strip() for d in visible.split(",")]
            if local_rank >= len(devices):
                raise ValueError(f"local_rank {local_rank} has no device in CUDA_VISIBLE_DEVICES={visible}")
            env["CUDA_VISIBLE_DEVICES"] = devices[local_rank]
    if "OMP_NUM_THREADS" in base_env:
        env["OMP_NUM_THREADS"] = base_env["OMP_NUM_THREADS"]
    elif spec.local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    return env


def log_line_prefixes(template: str | None, worker_group: WorkerGroup) -> dict[int, str] | None:
    """Each local rank's console header from ``log_line_prefix_template`` (pure); None keeps
    the default."""
    if not template:
        return None
    return {
        w.local_rank: Template(template).safe_substitute(
            role_name=worker_group.spec.role, rank=w.global_rank, local_rank=w.local_rank
        )
        for w in worker_group.workers
    }


def _substitute_local_rank(args: tuple[Any, ...], local_rank: int) -> tuple[Any, ...]:
    """torchrun's ``${local_rank}`` macro in string arguments."""
    return tuple(a.replace("${local_rank}", str(local_rank)) if isinstance(a, str) else a for a in args)


def await_warm(role: str, script_modules: bool) -> tuple[float, bool] | None:
    """Wait until the fork server has imported its preload (see
    :func:`kelastic.agent.warm.wait_ready`), at most :data:`WARM_WAIT` seconds, saying so
    every :data:`WARM_PROGRESS_EVERY` seconds: a node that joined a running group earlier
    would stop its workers and keep them waiting for that import. Returns the seconds
    waited and whether it is ready; None when there is no server of the agent's to wait for."""
    began = time.monotonic()
    ready = warm.wait_ready(WARM_PROGRESS_EVERY)
    if ready is None:
        return None  # no server of ours to wait for, or waited already
    while ready is False and time.monotonic() - began < WARM_WAIT:
        _log.info(
            "[%s] the fork server is still importing %s%s (%.0fs); joining after it",
            role,
            warm.PRELOAD[len(warm.AGENT_IMPORTS)],
            " and the script's modules" if script_modules else "",
            time.monotonic() - began,
        )
        ready = warm.wait_ready(WARM_PROGRESS_EVERY)
    if not ready:
        _log.warning(
            "[%s] the fork server is not ready after %.0fs; joining the rendezvous anyway", role, WARM_WAIT
        )
    return time.monotonic() - began, bool(ready)


def remove_scratch(owned_log_dir: Path | None, run_log_dir: Path) -> None:
    """Remove the workers' progress files and hand-off files (the agent's scratch, read only
    while they run) and, in a log directory the agent made itself (``owned_log_dir``), every
    directory left empty: a run without ``log_dir`` leaves nothing behind unless it wrote logs
    there (redirects), which stay. A ``log_dir`` the caller named keeps its directories."""
    if owned_log_dir is None or not run_log_dir.is_dir():
        return
    for pattern in ("attempt_*/*/progress.json", "spare_*/*/progress.json", "handoff_*/*/*.json"):
        for scratch in run_log_dir.glob(pattern):
            with contextlib.suppress(OSError):
                scratch.unlink()
    for directory, _, _ in sorted(os.walk(owned_log_dir), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):  # not empty: it holds logs
            os.rmdir(directory)


class LocalElasticAgent(SimpleElasticAgent):
    """Starts the workers with :func:`~kelastic.agent.multiprocessing.start_processes`.

    ``local_ranks_filter`` limits console output to those local ranks: the
    others are redirected to their log files only. ``progress`` turns the
    node's progress display on (default). ``rdzv_endpoint`` is where progress
    is published when the backend is kelastic; ``recovery`` (optional) gives the
    node's latest recovery ``(seconds, ended)`` published with it, ``failure`` (optional) the
    reason of its latest restart after a failure ``(reason, when)``. ``hang_timeout``
    (seconds, optional) turns on hang detection (:mod:`kelastic.agent.hang`): workers
    whose ranks all stopped reporting progress that long are failed and restarted,
    and the verdict is published with the node's progress. ``extra_env`` is added to
    every worker's environment (the checkpoint service's address);
    ``checkpoint_status`` (optional) gives the node's checkpoint state published with its
    progress; ``checkpoint_commits`` (optional) lets a restart for joining nodes wait for
    the group's next checkpoint (see :func:`kelastic.agent.restart_policy.defer_join`);
    ``checkpoint_ring`` (optional) is told each round's ring of checkpoint services;
    ``stragglers`` (optional, with the kelastic backend) is the straggler rule the node
    applies (:mod:`kelastic.agent.straggler_watch`). ``start_early``: the node starts its
    workers before its first rendezvous is over (a standby's, before it has a place), and they
    wait for their group (:mod:`kelastic.agent.keep`; only for a script under
    :func:`kelastic.inprocess.run`). ``warm_imports`` names the script's
    modules a ``forkserver`` start has the fork server import after torch.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs | None = None,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300.0,
        log_line_prefix_template: str | None = None,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        local_ranks_filter: set[int] | None = None,
        membership_grace: float | None = None,
        event_sink: EventSink | None = None,
        metrics: Metrics | None = None,
        progress: bool = True,
        rdzv_endpoint: str | None = None,
        recovery: Callable[[], tuple[float, float] | None] | None = None,
        failure: Callable[[], tuple[str, float] | None] | None = None,
        hang_timeout: float | None = None,
        extra_env: Mapping[str, str] | None = None,
        checkpoint_status: Callable[[], dict[str, Any]] | None = None,
        checkpoint_commits: CheckpointCommits | None = None,
        checkpoint_ring: CheckpointRing | None = None,
        stragglers: StragglerRule | None = None,
        warm_imports: Sequence[str] = (),
        start_early: bool = False,
    ) -> None:
        super().__init__(
            spec,
            exit_barrier_timeout=exit_barrier_timeout,
            membership_grace=membership_grace,
            event_sink=event_sink,
            metrics=metrics,
            checkpoint_commits=checkpoint_commits,
            checkpoint_ring=checkpoint_ring,
        )
        if logs_specs is not None and log_dir is not None:
            raise ValueError("pass either logs_specs (torch's) or log_dir (kelastic's), not both")
        self._logs_specs = logs_specs
        self._log_line_prefix_template = log_line_prefix_template
        self._start_method = start_method
        self._warm_imports = tuple(warm_imports)
        if start_method == "forkserver":
            # torch reads OMP_NUM_THREADS when the fork server imports it, before any worker env exists
            if spec.local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
                os.environ["OMP_NUM_THREADS"] = "1"
            prewarm_forkserver(script_modules=warm_imports)
        base = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kelastic_"))
        #: The temporary directory the agent made for want of a log_dir: removed at exit once
        #: nothing but its own scratch (progress files) is in it.
        self._owned_log_dir = base if log_dir is None else None
        self._run_log_dir = base / spec.rdzv_handler.get_run_id()
        self._attempt_base: int | None = None
        self._local_ranks_filter = local_ranks_filter
        self._pcontext: PContext | None = None
        #: The workers all returned and are held alive until the exit barrier is over.
        self._held = False
        self._progress_files: dict[int, str] = {}
        #: The running workers' hand-off (kelastic.agent.keep), unless KELASTIC_KEEP_WORKERS=0.
        self._keeper = Keeper(handoff.keep_enabled(os.environ))
        self._start_early_workers = start_early
        #: The node's next workers, started ahead (kelastic.agent.spare), with KELASTIC_SPARE_WORKERS=1.
        self._spares = Spares(
            start_early and logs_specs is None and self._keeper.enabled and spares_enabled(os.environ)
        )
        self._display: ProgressDisplay | None = None
        self._show_progress = progress
        self._rdzv_endpoint = rdzv_endpoint
        self._recovery = recovery
        self._failure = failure
        self._hang_timeout = hang_timeout
        self._extra_env = dict(extra_env or {})
        self._checkpoint_status = checkpoint_status
        #: The latest hang verdict: (global ranks, seconds without progress, when, epoch s).
        self._last_hang: tuple[tuple[int, ...], float, float] | None = None
        handler = spec.rdzv_handler
        #: Progress goes to the store of a rendezvous that names this node (kelastic's), with the
        #: MAC of the job's secret that its handler signs the round's records with.
        job_key = getattr(getattr(handler, "settings", None), "job_key", None)
        self._publisher = (
            ProgressPublisher(rdzv_endpoint, handler.get_run_id(), handler.node_name, job_key=job_key)
            if rdzv_endpoint and isinstance(handler, NamedNode)
            else None
        )
        self._goodput = GoodputLedger()
        #: The straggler rule's watch (:mod:`kelastic.agent.straggler_watch`), with the publisher.
        self._stragglers = (
            StragglerWatch(
                self._publisher.endpoint,
                self._publisher.run_id,
                self._publisher.node,
                stragglers,
                commits=checkpoint_commits,
                job_key=self._publisher.job_key,
            )
            if self._publisher is not None and stragglers is not None
            else None
        )

    @property
    def run_log_dir(self) -> Path:
        return self._run_log_dir

    def _attempt_dir(self, ahead: int = 0) -> Path:
        if self._attempt_base is None:
            used = [
                int(m.group(1))
                for p in (self._run_log_dir.iterdir() if self._run_log_dir.is_dir() else ())
                if (m := re.fullmatch(r"attempt_(\d+)", p.name))
            ]
            self._attempt_base = max(used) + 1 if used else 0
        return self._run_log_dir / f"attempt_{self._attempt_base + self.attempt + ahead}"

    def _std_maps(self, nprocs: int) -> tuple[dict[int, Std], dict[int, Std]]:
        spec = self._worker_group.spec
        redirects = to_std_map(spec.redirects, nprocs)
        tee = to_std_map(spec.tee, nprocs)
        if self._local_ranks_filter is not None:
            for lr in range(nprocs):
                if lr not in self._local_ranks_filter:
                    redirects[lr] = Std.ALL
                    tee[lr] = Std.NONE
        return redirects, tee

    # SimpleElasticAgent ---------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if self._start_method == "forkserver":
            waited = await_warm(worker_group.spec.role, bool(self._warm_imports))
            if waited is not None:
                self._event("kelastic.agent.warm_ready", seconds=round(waited[0], 3), ready=waited[1])
        if self._start_early_workers and self._pcontext is None and self._keeper.enabled and self.attempt < 0:
            self._start_early(worker_group)
        super()._rendezvous(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec, n = worker_group.spec, worker_group.spec.local_world_size
        if self._progress_files:  # a restart: where the ended attempt stopped, for the goodput
            self._goodput.restarted(self.rank_progress())
        envs = self._group_envs(worker_group, self._attempt_dir())
        if isinstance(self._stopping, KeptWorkers) and self._stopping.kept and self._pcontext is not None:
            self._keeper.hand_over(self._stopping, envs)
            return self._handed_over(worker_group)
        if self._pcontext is not None and self._keeper.take_early(self._pcontext.pids(), envs):
            return self._handed_over(worker_group)
        if self._pcontext is None and (spares := self._spares.take(envs)) is not None:
            self._pcontext, self._keeper = spares  # no process start: they parked long ago
            return self._handed_over(worker_group)
        if self._pcontext is not None:  # started early, and one of them did not wait for its group
            _log.warning(
                "[%s] a worker started early ended before it reached kelastic.inprocess.run (its "
                "output says why; a script that needs its group before run() can set "
                "KELASTIC_KEEP_WORKERS=0); starting the workers again",
                spec.role,
            )
            self._close_workers(signal.SIGTERM)
            self._attempt_base = (self._attempt_base or 0) + 1  # their attempt's logs stay as they are
            envs = self._group_envs(worker_group, self._attempt_dir())
        attempt_dir = self._attempt_dir()
        for lr, extra in self._keeper.started(attempt_dir, n).items():
            envs[lr] |= extra
        return self._launch(worker_group, envs, attempt_dir)

    def _group_envs(self, worker_group: WorkerGroup, attempt_dir: Path) -> dict[int, dict[str, str]]:
        """Each local rank's variables in ``worker_group``; its progress file in ``attempt_dir``."""
        spec, handler = worker_group.spec, worker_group.spec.rdzv_handler
        attempt_dir.parent.mkdir(parents=True, exist_ok=True)
        self._progress_files = {
            lr: str(progress_file(attempt_dir, lr)) for lr in range(spec.local_world_size)
        }
        base_env = dict(os.environ)
        return {
            lr: worker_env(
                spec,
                worker_group,
                lr,
                restart_count=self.restart_count,
                run_id=handler.get_run_id(),
                use_agent_store=bool(handler.use_agent_store),
                progress_file=self._progress_files[lr],
                base_env=base_env,
            )
            | self._extra_env
            for lr in range(spec.local_world_size)
        }

    def _start_early(self, worker_group: WorkerGroup) -> None:
        """The workers, started while the node's first rendezvous waits (see kelastic.inprocess)."""
        spec = worker_group.spec
        self._attempt_dir()  # numbers the attempts; this one is the first start's
        attempt_dir = self._attempt_dir(ahead=1)
        attempt_dir.parent.mkdir(parents=True, exist_ok=True)
        envs = self._early_envs(
            spec, attempt_dir, self._keeper.started_early(attempt_dir, spec.local_world_size)
        )
        if envs:  # else the keeper said why: the workers start with their group
            self._launch(worker_group, envs, attempt_dir)
            _log.info("[%s] workers started early; they wait for the node's group", spec.role)

    def _early_envs(
        self, spec: WorkerSpec, attempt_dir: Path, extra: Mapping[int, dict[str, str]]
    ) -> dict[int, dict[str, str]]:
        """The variables of workers started before they have a group (no rank yet)."""
        run_id, base_env = spec.rdzv_handler.get_run_id(), dict(os.environ)
        return {
            lr: local_env(
                spec, lr, run_id=run_id, progress_file=str(progress_file(attempt_dir, lr)), base_env=base_env
            )
            | self._extra_env
            | more
            for lr, more in extra.items()
        }

    def _launch(
        self, worker_group: WorkerGroup, envs: Mapping[int, dict[str, str]], attempt_dir: Path
    ) -> dict[int, Any]:
        self._pcontext = self._spawn(worker_group, envs, attempt_dir)
        self._held = False
        self._point_display(self._ensure_display())
        self._spares.running()
        # Published at every (re)start, not only on monitor ticks: workers that crash at
        # once never reach a tick, and the operator would show no restarts at all.
        self._publish_progress()
        return dict(self._pcontext.pids())

    def _spawn(
        self, worker_group: WorkerGroup, envs: Mapping[int, dict[str, str]], attempt_dir: Path
    ) -> PContext:
        spec, n = worker_group.spec, worker_group.spec.local_world_size
        args = {lr: _substitute_local_rank(spec.args, lr) for lr in range(n)}
        display = self._ensure_display()
        assert spec.entrypoint is not None  # WorkerSpec refuses a spec without one
        if self._logs_specs is not None:
            # The attempt directory still holds the progress files.
            for lr in range(n):
                (attempt_dir / str(lr)).mkdir(parents=True, exist_ok=True)
            where: dict[str, Any] = {"logs_specs": self._logs_specs}
        else:
            redirects, tee = self._std_maps(n)
            where = {"log_dir": str(attempt_dir), "redirects": redirects, "tee": tee}
        return start_processes(
            name=spec.role,
            entrypoint=spec.entrypoint,
            args=args,
            envs=dict(envs),
            start_method=self._start_method,
            progbar_events=None if display is None else display.events,
            log_line_prefixes=log_line_prefixes(self._log_line_prefix_template, worker_group),
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
            hold=True,  # released after the exit barrier: see _after_exit_barrier
            # Ranks failing together are reported together when they end within one poll,
            # as with torch's agent; ranks stuck in a collective never hold a restart back.
            failure_grace=spec.monitor_interval,
            **where,
        )

    def _begin_stop(self, worker_group: WorkerGroup) -> OverlappedStop | KeptWorkers:
        """Park the workers when they can be kept (:mod:`kelastic.agent.keep`), else stop them."""
        self._spares.stopped()
        if self._keep_allowed and self._keeper.enabled and self._pcontext is not None:
            pids = self._pcontext.pids()
            kept = self._keeper.begin(pids, lambda: self._stop_workers(worker_group), self._workers_stopped)
            if kept is not None:
                return kept
        return super()._begin_stop(worker_group)

    def _handed_over(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """The running workers were handed the new group (kept, or started early)."""
        assert self._pcontext is not None
        self._point_display(self._ensure_display())
        self._publish_progress()
        self._spares.running()
        self._event("kelastic.agent.workers_kept", generation=self._keeper.gen)
        _log.info(
            "[%s] kept the workers (generation %d): in their processes",
            worker_group.spec.role,
            self._keeper.gen,
        )
        return dict(self._pcontext.pids())

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if self._pcontext is not None:
            self._keeper.release(self._pcontext.pids())
        self._close_workers(signal.SIGTERM)

    def _close_workers(self, death_sig: signal.Signals) -> None:
        if self._pcontext is not None:
            pc, self._pcontext = self._pcontext, None
            pc.close(death_sig=death_sig)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._pcontext is None:
            return RunResult(state=WorkerState.UNKNOWN)
        by_local = {w.local_rank: w.global_rank for w in worker_group.workers}
        result = self._pcontext.wait(0)
        parked = self._keeper.parked_failures(self._pcontext.pids()) if result is None else {}
        if parked:  # kept workers whose training raised: the ranks' failures, the processes live on
            return run_results.parked(parked, by_local)
        if result is None:
            # Callable workers that all returned are held alive until the exit barrier is
            # over (see _after_exit_barrier): for the group they have succeeded.
            result = self._pcontext.returned()
            if result is None:
                return self._judge_hang(worker_group) or RunResult(state=WorkerState.HEALTHY)
            self._held = True
        if not result.is_failed():
            # The workers' last steps, published before the agent waits at the exit barrier
            # and its pod ends: otherwise the job's status would keep the previous tick's.
            self._publish_progress(final=True)
        return run_results.ended(result, by_local)

    def _after_exit_barrier(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        """Release the workers held since they returned, and wait until they exited.

        Holding them until every agent reached the exit barrier means no rank of the job
        exits (and tears down its process group) while a rank on another node still runs
        its function; the barrier bounds the hold (``exit_barrier_timeout``, and kelastic's
        barrier ends at once when a member was lost). A worker that returned but then
        exits with an error (or a signal) fails the run, as with torch.
        """
        pc = self._pcontext
        if not self._held or pc is None:
            return result
        self._held = False
        role = worker_group.spec.role
        pc.release()
        began = time.monotonic()
        while (
            done := pc.wait(timeout=EXIT_PROGRESS_EVERY, period=worker_group.spec.monitor_interval)
        ) is None:
            _log.warning(
                "[%s] workers with pids %s returned and were released %.0fs ago but have not exited "
                "(their atexit handlers or non-daemon threads still run)",
                role,
                sorted(pc.pids().values()),
                time.monotonic() - began,
            )
        if not done.is_failed():
            return result
        failed = run_results.ended(done, {w.local_rank: w.global_rank for w in worker_group.workers})
        _log.error(
            "[%s] workers failed while exiting after they returned: ranks %s", role, sorted(failed.failures)
        )
        worker_group.state = WorkerState.FAILED
        return failed

    def _judge_hang(self, worker_group: WorkerGroup) -> RunResult | None:
        """With a hang timeout: a FAILED result naming the stalled ranks when the workers hang
        (:mod:`kelastic.agent.hang`), so the loop restarts the group and spends a restart."""
        if not self._hang_timeout or self._pcontext is None:
            return None
        verdict = hang.judge(self.rank_progress(), now=time.time(), timeout=self._hang_timeout)
        if verdict is None:
            return None
        by_local = {w.local_rank: w.global_rank for w in worker_group.workers}
        message = verdict.describe(by_local, self._hang_timeout)
        _log.error("[%s] %s", worker_group.spec.role, message)
        self._last_hang = (tuple(by_local[lr] for lr in verdict.local_ranks), verdict.seconds, verdict.at)
        return run_results.hung(verdict, by_local, self._pcontext.pids(), message)

    @property
    def last_hang(self) -> tuple[tuple[int, ...], float, float] | None:
        """The latest hang verdict: (global ranks, seconds without progress, when in epoch seconds)."""
        return self._last_hang

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM) -> None:
        self._close_workers(death_sig)
        if self._leave_once_stopped:  # a signal: the group re-forms without this node now
            self._leave_round()
        self._spares.close()
        self._stop_display()
        if self._publisher is not None:
            self._publisher.close()
        remove_scratch(self._owned_log_dir, self._run_log_dir)

    def _on_monitor_tick(self, worker_group: WorkerGroup) -> None:
        mismatch = getattr(self._checkpoint_ring, "secret_mismatch", None)
        if mismatch:  # this node holds another secret than the job's: it must not train on
            raise SecretMismatch(mismatch)
        if self._publisher is not None and self._publisher.due():
            self._publish_progress()
        if not self._spares.enabled:
            return  # no closures to build on every tick
        spec = worker_group.spec
        self._spares.tick(
            self._run_log_dir,
            spec.local_world_size,
            lambda at: self._early_envs(spec, at, {lr: {} for lr in range(spec.local_world_size)}),
            lambda envs, at: self._spawn(worker_group, envs, at),
        )

    def _step_aside(self, worker_group: WorkerGroup) -> str | None:
        """A straggler named for replacement leaves its round at the checkpoint (see
        :mod:`kelastic.agent.straggler_watch`); the restart then parks it as a standby."""
        watch = self._stragglers
        if watch is None:
            return None
        from kelastic.agent.rendezvous import handler as kelastic_rdzv  # only with the kelastic backend

        handler = worker_group.spec.rdzv_handler
        if not isinstance(handler, kelastic_rdzv.KelasticRendezvousHandler):
            return None
        round_ = kelastic_rdzv.current_round(handler)
        reason = watch.tick(leader=worker_group.group_rank == 0, round_=round_)
        if reason is None or not kelastic_rdzv.step_aside(handler):
            return None
        watch.replaced(round_)
        self._event("kelastic.agent.straggler", node=watch.node, round=round_, action="replaced")
        return f"{reason} (a membership change: it re-joins as a standby)"

    def straggler_verdict(self) -> Mapping[str, Any] | None:
        """The group's latest straggler verdict this agent read (None: none, or not watched)."""
        return None if self._stragglers is None else self._stragglers.verdict

    # progress ---------------------------------------------------------------------------------
    def _ensure_display(self) -> ProgressDisplay | None:
        if not self._show_progress:
            return None
        if self._display is None:
            self._display = ProgressDisplay(name=self._worker_group.spec.role).start()
        return self._display

    def _point_display(self, display: ProgressDisplay | None) -> None:
        if display is not None:
            display.set_progress_files(self._progress_files)

    def _stop_display(self) -> None:
        if self._display is not None:
            display, self._display = self._display, None
            display.stop()

    def rank_progress(self) -> dict[int, ProgressReport]:
        """The latest report of each local rank of the current attempt that reported (by local rank)."""
        reports = {lr: read_report(p) for lr, p in dict(self._progress_files).items()}
        return {lr: r for lr, r in reports.items() if r is not None}

    def node_progress(self) -> NodeProgress | None:
        """The current attempt's progress (slowest local rank), or None before any report."""
        if self._display is not None:
            return self._display.snapshot()
        reports = {lr: read_report(p) for lr, p in self._progress_files.items()}
        return aggregate({lr: r for lr, r in reports.items() if r is not None})

    def _publish_progress(self, *, final: bool = False) -> None:
        """Publish this node's progress, restart count and size to the rendezvous store (best
        effort, see :class:`~kelastic.agent.progress_publisher.ProgressPublisher`); ``final``:
        the ranks' files as they are now, not the display's latest periodic read of them."""
        if self._publisher is None:
            return
        self._goodput.observe(self.rank_progress())
        self._publisher.publish(
            aggregate(self.rank_progress()) if final else self.node_progress(),
            goodput=self._goodput.record(),
            restarts=self.restart_count,
            local_world_size=self._worker_group.spec.local_world_size,
            recovery=self._recovery() if self._recovery is not None else None,
            failure=self._failure() if self._failure is not None else None,
            hang=self._last_hang,
            checkpoint=self._checkpoint_status() if self._checkpoint_status is not None else None,
            round_=self._rdzv_round(),
        )

    def _rdzv_round(self) -> int | None:
        """The round of kelastic's rendezvous this node is a member of (None: another backend)."""
        from kelastic.agent.rendezvous import handler as kelastic_rdzv  # only with the kelastic backend

        handler = self._worker_group.spec.rdzv_handler
        if not isinstance(handler, kelastic_rdzv.KelasticRendezvousHandler):
            return None
        return kelastic_rdzv.current_round(handler)
