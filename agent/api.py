"""The elastic agent's contract: worker specs, worker groups, run results, and the agent loop.

An *agent* runs on every node. It takes part in a rendezvous with the other
agents, learns its group rank and the group's size, assigns ranks to its local
workers, starts them, and watches them until the job succeeds, fails, or the
membership of the group changes.

The pieces a caller may rely on:

* :class:`WorkerSpec` describes identical local workers; it validates itself on
  construction and raises :class:`ValueError` naming the bad field.
* :func:`assign_ranks` is the pure rank-assignment rule: global ranks are
  offsets by group rank (agent ``g`` owns ``[sum of local_world_size of agents
  before g, ... + its own)``), role ranks are the same rule applied over the
  agents of one role, sorted by (role, group rank). Agents may have different
  ``local_world_size``. :func:`exchange_rank_assignments` is its store I/O:
  every agent publishes its role info, group rank 0 computes all assignments
  once and publishes them, every agent reads its own (O(1) per agent, O(n) on
  rank 0).
* :class:`SimpleElasticAgent` implements the monitor loop:

  - SUCCEEDED: wait at the exit barrier (bounded by ``exit_barrier_timeout``;
    a timeout is logged, not fatal) and return the result;
  - FAILED/UNHEALTHY (the rule is pure, in :mod:`kelastic.agent.restart_policy`):
    if the failure was caused by the group changing (with kelastic's handler,
    a :class:`LossWatcher`: a member of the round died, left or was dropped;
    with others: any membership change), checked for up to
    ``membership_grace`` seconds when the round has peers, since a peer's death
    usually shows up first as a failed collective (default: the handler's
    ``loss_notice``, about 2 s with kelastic's peer link; its heartbeat timeout
    when no restart is left, since the verdict then ends the job), restart
    *without* spending a restart; else restart while restarts remain, else stop
    the workers and return the failure. A peer that re-joined without a loss
    ends the wait at once: its workers failed too, and the failure is the
    group's own;
  - ``TORCHELASTIC_RESTART_COUNT`` is the group's: the most restarts any agent
    of the round spent (:class:`RankAssignment`), so all ranks of an attempt
    agree on it;
  - HEALTHY: with a handler that can watch membership (kelastic's, which has
    ``wait_membership_change``) the loop blocks on the store instead of
    sleeping and restarts at once, without spending a restart, when the
    membership changed; with torch's handlers (``c10d``, ``static``) it sleeps
    ``monitor_interval`` and restarts when ``num_nodes_waiting() > 0``.

  A :class:`~kelastic.agent.multiprocessing.SignalException` raised while the
  agent runs (SIGTERM, SIGINT, ... delivered to the agent) stops the workers
  with that same signal and is re-raised.
* Events (:mod:`kelastic.agent.events`) and metrics (:mod:`kelastic.agent.metrics`)
  go to pluggable sinks given to the agent.

Compatibility with ``torch.distributed.elastic.agent.server``: :class:`WorkerSpec` takes
torch 2.13's fields (``fn``, deprecated in favour of ``entrypoint`` and accepted with a
``DeprecationWarning``; ``event_log_handler``, ``numa_options``, ``virtual_local_rank``,
``duplicate_stdout_filters``, ``duplicate_stderr_filters``), and a spec may be built
without a rendezvous handler (``rdzv_handler=None``); an agent refuses such a spec.
:class:`SimpleElasticAgent` has ``get_event_succeeded()``/``get_event_failed()``. Where
kelastic deliberately differs:

* ``WorkerSpec`` validates itself and raises ``ValueError`` naming the field (torch raises
  a bare ``AssertionError``); ``fn`` comes last among the fields, after kelastic's
  ``redirects``/``tee``, so that kelastic's positional order stays as it was;
* ``event_log_handler`` is kept on the spec but events go to the agent's ``event_sink``
  (:mod:`kelastic.agent.events`), which is where kelastic lets a caller choose them;
  event names are ``kelastic.*``, not ``torchelastic.worker.status.*``;
* ``numa_options`` must be ``None``: kelastic does not bind workers to NUMA nodes.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import signal
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch.distributed.elastic.utils.store as torch_store_util
from torch.distributed import DistStoreError, Store
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

from kelastic.agent import restart_policy, warm
from kelastic.agent.events import Event, EventSink, EventSource, default_sink, record
from kelastic.agent.join_at_checkpoint import CheckpointCommits, JoinAtCheckpoint
from kelastic.agent.keep import KeptWorkers
from kelastic.agent.metrics import Metrics
from kelastic.agent.multiprocessing import ProcessFailure, SignalException, Std
from kelastic.agent.oom import OomWatch
from kelastic.agent.reform import OverlappedStop
from kelastic.agent.restart_policy import Action, LossQuestion, Verdict, Watching

__all__ = [
    "DEFAULT_ROLE",
    "CheckpointCommits",
    "CheckpointRing",
    "ElasticAgent",
    "FinishBarrier",
    "LossWatcher",
    "MembershipChangedError",
    "MembershipWatcher",
    "NamedNode",
    "RankAssignment",
    "RecordSigning",
    "RoleInstanceInfo",
    "RoundWatcher",
    "RunResult",
    "SignedRecords",
    "SimpleElasticAgent",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "assign_ranks",
    "exchange_rank_assignments",
    "exit_barrier",
]

_log = logging.getLogger(__name__)

DEFAULT_ROLE = "default"

_ROLE_INFO_PREFIX = "kelastic/role_info/"
_ASSIGNED_PREFIX = "kelastic/assigned_ranks/"
#: torch's key for the exit barrier on its handlers' store (its agent's ``_TERMINAL_STATE_SYNC_ID``).
_TERMINAL_STATE_SYNC_ID = "torchelastic/agent/terminal_state"


@runtime_checkable
class MembershipWatcher(Protocol):
    """What the agent may ask of a rendezvous handler beyond torch's ``RendezvousHandler``.

    A handler that has these (kelastic's) lets the agent wait on the membership instead of
    sleeping, restart at once when a peer is lost or joins, and tell a failure caused by a
    lost peer from a failure of its own. With a handler that has not (torch's ``c10d`` and
    ``static``), the agent polls ``num_nodes_waiting()`` every ``monitor_interval``.
    """

    def membership_changed(self) -> bool:
        """True once the round this node is a member of is no longer the current one."""
        ...

    def wait_membership_change(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True as soon as :meth:`membership_changed` is."""
        ...


@runtime_checkable
class LossWatcher(Protocol):
    """A rendezvous handler that can tell a lost member from a re-formed round (kelastic's).

    With one, a failure of this node's workers is free only when a member of the
    round was actually lost (dead, left, dropped); a peer that merely re-joined
    after its own workers failed does not excuse it. Without one, any membership
    change within the grace period excuses it. Such a handler's ``shutdown()`` is
    this node's graceful leave, and ``set_closed()`` ends the job for everyone.
    """

    def wait_member_lost(self, timeout: float) -> bool:
        """Block up to ``timeout`` s; True once a member of this node's round was lost (or
        announced it is leaving), False once a peer re-joined without a loss, or on timeout."""
        ...

    def wait_previous_round_lost(self, timeout: float) -> bool:
        """After re-joining: block up to ``timeout`` s; True once a member of the round this
        node was in before was lost, False once all of them are accounted for without a
        loss, on timeout, or when there was no round before."""
        ...

    def announce_leaving(self) -> None:
        """Tell the round this node is stopping its workers to leave (best effort)."""
        ...

    @property
    def loss_notice(self) -> float:
        """Seconds a lost member may take to show after its process is gone."""
        ...


@runtime_checkable
class RoundWatcher(Protocol):
    """A handler that tells when its node's round is over for the group (kelastic's): a member
    re-joined the next round or was lost, so the group makes no progress whatever nodes wait."""

    def round_over(self) -> bool:
        """Non-blocking; False when this node is no member of a round."""
        ...


class CheckpointRing(Protocol):
    """The node's checkpoint service as the rendezvous sees it (kelastic's
    :class:`~kelastic.agent.checkpoint.service.CheckpointService`): the agents exchange their
    endpoints with their role infos and each tells its own service the round's ring."""

    @property
    def endpoint(self) -> str:
        """Where this node's service is reached (``HOST:PORT``)."""
        ...

    def set_ring(self, ring: Sequence[str]) -> None:
        """The group's services in group rank order, for the round that just closed."""
        ...


@runtime_checkable
class NamedNode(Protocol):
    """A rendezvous handler that names this node in the rendezvous store (kelastic's).

    The agent publishes the node's progress under that name (see
    :class:`kelastic.agent.progress_publisher.ProgressPublisher`), where the operator reads it.
    """

    @property
    def node_name(self) -> str: ...


class RecordSigning(Protocol):
    """Signs and checks store records (:class:`kelastic.agent.rendezvous.records.RecordSigner`)."""

    def sign(self, name: str, value: str) -> str: ...

    def open(self, name: str, stored: bytes | str | None) -> bytes | None: ...


@runtime_checkable
class SignedRecords(Protocol):
    """A rendezvous handler whose job has a secret under which the round's records are signed
    (kelastic's, given a job secret).

    The agent signs what it exchanges in the round's store (its role info, with its checkpoint
    service's endpoint; group rank 0's rank assignments, with the checkpoint ring) and takes
    only what holds its MAC: a stranger with access to the store cannot put itself on the
    ring or hand out ranks. ``round_signer()`` is None without a secret (records unsigned).
    """

    def round_signer(self) -> RecordSigning | None: ...


@dataclass
class WorkerSpec:
    """What to run on this node: ``local_world_size`` identical workers of one ``role``.

    ``entrypoint`` is a program path/binary (``str``, run with ``args``) or a
    Python callable (called with ``args`` in a child process). ``master_addr``/
    ``master_port`` override what the rendezvous hands out (static setups).
    ``redirects``/``tee`` are :class:`~kelastic.agent.multiprocessing.Std`
    values or per-local-rank maps of them.

    torch's fields: ``fn`` (deprecated: becomes ``entrypoint``, with a
    ``DeprecationWarning``), ``event_log_handler`` (kept, see the module docstring),
    ``numa_options`` (``None`` only), ``virtual_local_rank`` (every worker gets
    ``LOCAL_RANK=0`` and ``CUDA_VISIBLE_DEVICES`` naming its own device),
    ``duplicate_stdout_filters``/``duplicate_stderr_filters`` (teed lines containing one
    of these strings are also copied to ``filtered_stdout.log``/``filtered_stderr.log``
    of the attempt's log directory). ``rdzv_handler`` may be None here; an agent
    refuses such a spec.
    """

    role: str
    local_world_size: int
    rdzv_handler: RendezvousHandler
    entrypoint: Callable[..., Any] | str | None = None
    args: tuple[Any, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    event_log_handler: str = "null"
    numa_options: Any = None
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    fn: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.fn is not None:
            warnings.warn(
                "WorkerSpec.fn is deprecated; use WorkerSpec.entrypoint", DeprecationWarning, stacklevel=3
            )
            self.entrypoint = self.fn
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"WorkerSpec.role must be a non-empty string, got {self.role!r}")
        if isinstance(self.local_world_size, bool) or not isinstance(self.local_world_size, int):
            raise ValueError(
                f"WorkerSpec.local_world_size must be an int (processes on this node), got {self.local_world_size!r}"
            )
        if self.local_world_size < 1:
            raise ValueError(f"WorkerSpec.local_world_size must be >= 1, got {self.local_world_size}")
        if self.rdzv_handler is not None and not callable(
            getattr(self.rdzv_handler, "next_rendezvous", None)
        ):
            raise ValueError(
                "WorkerSpec.rdzv_handler must be a RendezvousHandler (it has no next_rendezvous())"
            )
        if self.numa_options is not None:
            raise ValueError(
                "WorkerSpec.numa_options must be None: kelastic does not bind workers to NUMA nodes"
            )
        if self.entrypoint is None or (isinstance(self.entrypoint, str) and not self.entrypoint.strip()):
            raise ValueError("WorkerSpec.entrypoint is required: a program path or a Python callable")
        if not isinstance(self.entrypoint, str) and not callable(self.entrypoint):
            raise ValueError(
                f"WorkerSpec.entrypoint must be a str or a callable, got {type(self.entrypoint).__name__}"
            )
        self.args = tuple(self.args)
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, int)
            or self.max_restarts < 0
        ):
            raise ValueError(f"WorkerSpec.max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if not isinstance(self.monitor_interval, (int, float)) or not self.monitor_interval > 0:
            raise ValueError(
                f"WorkerSpec.monitor_interval must be > 0 seconds, got {self.monitor_interval!r}"
            )
        if self.master_port is not None and not (0 < int(self.master_port) < 65536):
            raise ValueError(f"WorkerSpec.master_port must be in 1..65535, got {self.master_port!r}")

    def get_entrypoint_name(self) -> str:
        """The program's name for logs: the path's basename or the callable's ``__qualname__``
        (for kelastic's script runners, the script's basename)."""
        if isinstance(self.entrypoint, str):
            return os.path.basename(self.entrypoint)
        if self.entrypoint in (warm.run_script, warm.run_module) and self.args:
            return os.path.basename(str(self.args[0]))
        return getattr(self.entrypoint, "__qualname__", repr(self.entrypoint))


@dataclass
class Worker:
    """One local worker; ranks are -1 until a rendezvous assigned them. ``id`` is its pid once started."""

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    id: Any = None


class WorkerState(str, Enum):
    """State of a worker group (all workers of one agent, as a unit)."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        """True when the workers exist and may be doing work (HEALTHY or UNHEALTHY)."""
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


@dataclass
class WorkerGroup:
    """The workers of one spec on this node, with what the last rendezvous told them."""

    spec: WorkerSpec
    workers: list[Worker] = field(default_factory=list)
    store: Store | None = None
    group_rank: int | None = None
    group_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    state: WorkerState = WorkerState.INIT

    def __post_init__(self) -> None:
        if not self.workers:
            self.workers = [Worker(local_rank=i) for i in range(self.spec.local_world_size)]


@dataclass
class RunResult:
    """Outcome of a worker group, all-or-nothing.

    On success ``return_values`` maps global rank → return value (callables)
    or ``None`` (programs). On failure ``failures`` maps global rank →
    :class:`~kelastic.agent.multiprocessing.ProcessFailure` of every failed worker.
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED


# --- rank assignment -------------------------------------------------------------------


@dataclass(frozen=True)
class RoleInstanceInfo:
    """What one agent tells the others before ranks are assigned.

    ``restarts`` is how many restarts this agent has spent (its own budget); ``endpoint``
    its checkpoint service (empty without one).
    """

    role: str
    rank: int  # group rank of the agent
    local_world_size: int
    restarts: int = 0
    endpoint: str = ""

    def to_json(self) -> str:
        return json.dumps([self.role, self.rank, self.local_world_size, self.restarts, self.endpoint])

    @staticmethod
    def from_json(data: str | bytes) -> RoleInstanceInfo:
        role, rank, lws, *rest = json.loads(data)
        return RoleInstanceInfo(
            str(role),
            int(rank),
            int(lws),
            int(rest[0]) if rest else 0,
            str(rest[1]) if len(rest) > 1 else "",
        )


@dataclass(frozen=True)
class RankAssignment:
    """An agent's share of ranks: its workers get ``base_* + local_rank``.

    ``group_restart_count`` is the worker group's restart count for this round, the
    same for every agent of the round: the most restarts any of its agents spent.
    It is what workers get as ``TORCHELASTIC_RESTART_COUNT``, so every rank of an
    attempt agrees on it, including ranks on an agent that was spared (its peer's
    failure cost it nothing) or that joined late. ``ring`` is the round's checkpoint
    services in group rank order (the same for every agent of the round).
    """

    base_global_rank: int
    global_world_size: int
    base_role_rank: int
    role_world_size: int
    group_restart_count: int = 0
    ring: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            [
                self.base_global_rank,
                self.global_world_size,
                self.base_role_rank,
                self.role_world_size,
                self.group_restart_count,
                list(self.ring),
            ]
        )

    @staticmethod
    def from_json(data: str | bytes) -> RankAssignment:
        a, b, c, d, *rest = json.loads(data)
        ring = tuple(str(e) for e in rest[1]) if len(rest) > 1 else ()
        return RankAssignment(int(a), int(b), int(c), int(d), int(rest[0]) if rest else 0, ring)


def assign_ranks(infos: Sequence[RoleInstanceInfo]) -> dict[int, RankAssignment]:
    """Rank assignment for a whole group, keyed by group rank (pure).

    ``infos`` must hold exactly group ranks ``0..n-1``. Global ranks follow
    group rank order; role ranks follow (role, group rank) order within a role.
    """
    by_rank = sorted(infos, key=lambda i: i.rank)
    ranks = [i.rank for i in by_rank]
    if ranks != list(range(len(by_rank))):
        raise ValueError(f"rank assignment needs group ranks 0..{len(by_rank) - 1}, got {ranks}")
    global_size = sum(i.local_world_size for i in by_rank)
    role_sizes: dict[str, int] = {}
    for info in by_rank:
        role_sizes[info.role] = role_sizes.get(info.role, 0) + info.local_world_size

    base_global: dict[int, int] = {}
    offset = 0
    for info in by_rank:
        base_global[info.rank] = offset
        offset += info.local_world_size

    base_role: dict[int, int] = {}
    role_offsets: dict[str, int] = {}
    for info in sorted(by_rank, key=lambda i: (i.role, i.rank)):
        base_role[info.rank] = role_offsets.get(info.role, 0)
        role_offsets[info.role] = base_role[info.rank] + info.local_world_size

    group_restarts = max(i.restarts for i in by_rank)
    ring = tuple(i.endpoint for i in by_rank if i.endpoint)
    return {
        info.rank: RankAssignment(
            base_global_rank=base_global[info.rank],
            global_world_size=global_size,
            base_role_rank=base_role[info.rank],
            role_world_size=role_sizes[info.role],
            group_restart_count=group_restarts,
            ring=ring,
        )
        for info in by_rank
    }


class MembershipChangedError(RuntimeError):
    """The rendezvous membership changed while the agents were still setting up a round."""


#: How often a wait for peers re-checks whether the round is still current.
_ABORT_CHECK_PERIOD = 0.5


def _wait_keys(
    store: Store, keys: list[str], timeout: float, what: str, abort: Callable[[], bool] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        slice_ = remaining if abort is None else min(remaining, _ABORT_CHECK_PERIOD)
        try:
            store.wait(keys, timedelta(seconds=max(slice_, 0.001)))
            return
        except Exception as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}: {e}") from e
        if abort is not None and abort():
            raise MembershipChangedError(f"the rendezvous membership changed while waiting for {what}")


#: How often a reader re-reads a record that was there but not signed by the job.
_UNSIGNED_RETRY = 0.1


def _read_signed(
    store: Store,
    keys: list[str],
    signer: RecordSigning | None,
    timeout: float,
    what: str,
    abort: Callable[[], bool] | None,
) -> list[bytes]:
    """The values of ``keys`` once every one is there and signed by the job (see ``SignedRecords``).

    A record that fails its MAC (a stranger's) is ignored as if absent: the reader waits
    for the job's own, within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        _wait_keys(store, keys, max(deadline - time.monotonic(), 0.001), what, abort)
        raw = list(store.multi_get(keys))
        if signer is None:
            return raw
        values = [signer.open(k, v) for k, v in zip(keys, raw, strict=True)]
        if all(v is not None for v in values):
            return [v for v in values if v is not None]
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"timed out after {timeout:.0f}s waiting for {what}: records not signed by the job"
            )
        if abort is not None and abort():
            raise MembershipChangedError(f"the rendezvous membership changed while waiting for {what}")
        time.sleep(_UNSIGNED_RETRY)


def exchange_rank_assignments(
    store: Store,
    group_rank: int,
    group_world_size: int,
    role: str,
    local_world_size: int,
    timeout: float = 300.0,
    abort: Callable[[], bool] | None = None,
    restarts: int = 0,
    endpoint: str = "",
    signer: RecordSigning | None = None,
) -> RankAssignment:
    """Publish this agent's role info, let group rank 0 assign all ranks, return this agent's share.

    ``restarts`` is what this agent spent of its restart budget; the share's
    ``group_restart_count`` is the round's maximum of them (see :class:`RankAssignment`).
    ``endpoint`` is this agent's checkpoint service, which the share's ``ring`` lists with
    the others' in group rank order.

    ``store`` must be private to the current rendezvous round (the handlers'
    ``RendezvousInfo.store`` is). Raises :class:`TimeoutError` naming what it
    waited for when peers do not show up within ``timeout`` seconds, and
    :class:`MembershipChangedError` as soon as ``abort()`` (checked every half
    second while waiting) returns True.

    ``signer`` (the round's, see :class:`SignedRecords`): every record is written with
    its MAC and read only with a valid one; None writes and reads them unsigned.
    """

    def sign(key: str, value: str) -> str:
        return value if signer is None else signer.sign(key, value)

    me = RoleInstanceInfo(role, group_rank, local_world_size, restarts, endpoint)
    mine = f"{_ROLE_INFO_PREFIX}{group_rank}"
    store.set(mine, sign(mine, me.to_json()))
    if group_rank == 0:
        keys = [f"{_ROLE_INFO_PREFIX}{i}" for i in range(group_world_size)]
        what = f"role info of all {group_world_size} agents"
        infos = [
            RoleInstanceInfo.from_json(v) for v in _read_signed(store, keys, signer, timeout, what, abort)
        ]
        assignments = assign_ranks(infos)
        names = [f"{_ASSIGNED_PREFIX}{r}" for r in range(group_world_size)]
        # torch implements Store.multi_set but its stubs do not declare it.
        store.multi_set(  # type: ignore[attr-defined]
            names, [sign(n, assignments[r].to_json()) for r, n in enumerate(names)]
        )
        return assignments[0]
    key = f"{_ASSIGNED_PREFIX}{group_rank}"
    (value,) = _read_signed(store, [key], signer, timeout, "rank assignment from group rank 0", abort)
    return RankAssignment.from_json(value)


def workers_for(assignment: RankAssignment, local_world_size: int) -> list[Worker]:
    """The local workers an assignment describes."""
    return [
        Worker(
            local_rank=lr,
            global_rank=assignment.base_global_rank + lr,
            role_rank=assignment.base_role_rank + lr,
            world_size=assignment.global_world_size,
            role_world_size=assignment.role_world_size,
        )
        for lr in range(local_world_size)
    ]


@runtime_checkable
class FinishBarrier(Protocol):
    """A rendezvous handler that runs the exit barrier itself (kelastic's).

    Its barrier rides out a restart of the rendezvous store, where :func:`exit_barrier`
    over the round's store connection fails at the first request after one.
    """

    def wait_all_finished(self, timeout: float) -> bool:
        """Mark this member finished; block up to ``timeout`` s; True once every member is,
        False once a member that is not was lost, or on timeout."""
        ...


def exit_barrier(store: Store, world_size: int, timeout: float) -> bool:
    """Block until ``world_size`` agents arrived (each calls once per round); False on timeout.

    For handlers that are not a :class:`FinishBarrier` (torch's ``c10d`` and ``static``):
    torch's own barrier, ``torch.distributed.elastic.utils.store.barrier``, under torch's
    key, so that torch's agents and kelastic's of one job meet at the same barrier (and a
    test that patches torch's function sees the call). Other errors propagate.
    """
    try:
        torch_store_util.barrier(
            store=store, world_size=world_size, key_prefix=_TERMINAL_STATE_SYNC_ID, barrier_timeout=timeout
        )
    except DistStoreError:
        return False
    return True


# --- agents ----------------------------------------------------------------------------


def _timings_metadata(handler: RendezvousHandler) -> dict[str, float | None]:
    """The phases of the handler's latest rendezvous (``rdzv_started``, ``rdzv_joined``,
    ``rdzv_closed``, ``rdzv_returned``: wall-clock seconds), for the rendezvous
    event; empty for a handler that does not time them (torch's own)."""
    timings = getattr(handler, "last_timings", None)
    if timings is None:
        return {}
    return {
        f"rdzv_{phase}": getattr(timings, phase, None)
        for phase in ("started", "joined", "closed", "returned")
    }


def _default_grace(handler: RendezvousHandler, *, final: bool = False) -> float:
    """How long a failure may precede the membership change that explains it.

    A peer's death usually breaks a collective at once. kelastic's handler says
    how soon it sees a loss (:attr:`LossWatcher.loss_notice`: about two keep-alive
    periods with its peer link, else its heartbeat timeout). ``final``: the
    failure would end the job (no restart left), so wait as long as the slowest
    detection, the heartbeat timeout: a loss seen late there costs the whole job,
    where elsewhere it costs one restart. For other handlers with a heartbeat
    setting: ``settings.node_timeout`` plus one keep-alive period.
    (torch's c10d handler has ``settings`` too, without a ``node_timeout``: hence the checks.)
    """
    if isinstance(handler, LossWatcher) and not final:
        return float(handler.loss_notice)
    settings = getattr(handler, "settings", None)
    node_timeout = getattr(settings, "node_timeout", None)
    interval = getattr(settings, "keep_alive_interval", None)
    if isinstance(node_timeout, (int, float)) and isinstance(interval, (int, float)):
        return float(node_timeout) + float(interval)
    return 3.0


def _final_event(
    wg: WorkerGroup,
    agent: dict[str, Any],
    state: str,
    raw_error: str | None,
    *,
    total_run_time: float,
    restarts: int,
) -> Event:
    """The agent's SUCCEEDED or FAILED event (torch's), from what every agent event says
    about the agent (``agent``) and how the run ended."""
    md = {
        **agent,
        "group_world_size": wg.group_world_size,
        "state": state,
        "total_run_time": round(total_run_time, 3),
        "raw_error": raw_error,
        "entry_point": wg.spec.get_entrypoint_name(),
        "agent_restarts": restarts,
    }
    name = "kelastic.agent.succeeded" if state == "SUCCEEDED" else "kelastic.agent.failed"
    return Event(name=name, source=EventSource.AGENT, metadata=md)


class ElasticAgent(abc.ABC):
    """Runs one node's workers of a distributed job; ``run`` blocks until they finish."""

    @abc.abstractmethod
    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers; return the group's outcome.

        Raises :class:`~kelastic.agent.multiprocessing.SignalException` when the
        agent itself was told to stop (after stopping the workers with the signal).
        """

    @abc.abstractmethod
    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """The worker group of ``role`` (a single role per agent for now)."""


def _announce_leaving(handler: RendezvousHandler) -> None:
    """Before stopping on a signal: let peers judge what their workers see next a loss."""
    if isinstance(handler, LossWatcher):
        try:
            handler.announce_leaving()
        except Exception as e:  # best effort: stopping matters more
            _log.warning("could not announce leaving the rendezvous: %s", e)


def _leave_now(handler: RendezvousHandler) -> None:
    """After a signal, once the workers are stopped: leave the round now (fate ``left``, the
    survivors re-form at once) rather than after the rest of the shutdown (spares, logs, the
    last progress); the launcher's later leave then finds nothing to do."""
    if isinstance(handler, LossWatcher):
        try:
            handler.shutdown()
        except Exception as e:  # best effort: the launcher tries again
            _log.warning("could not leave the rendezvous: %s", e)


def _leave_ring(ring: CheckpointRing | None) -> None:
    """This node left its round (a straggler stepping aside): off the checkpoint ring it knew,
    so that as a standby it takes every member's part, the new round's included (the ring it
    knew would refuse them as from no node of it)."""
    if ring is not None:
        ring.set_ring(())


class SimpleElasticAgent(ElasticAgent):
    """The rendezvous/monitor/restart algorithm; subclasses say how workers start and stop.

    Subclasses implement ``_start_workers`` (returns local rank → worker id),
    ``_stop_workers``, ``_monitor_workers`` (a :class:`RunResult` whose state is
    HEALTHY while they run) and ``_shutdown`` (stop everything, with a signal).
    Hooks ``_on_rendezvous`` and ``_on_monitor_tick`` let them react to a new
    round and publish progress.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        exit_barrier_timeout: float = 300.0,
        membership_grace: float | None = None,
        event_sink: EventSink | None = None,
        metrics: Metrics | None = None,
        checkpoint_commits: CheckpointCommits | None = None,
        checkpoint_ring: CheckpointRing | None = None,
    ) -> None:
        if spec.rdzv_handler is None:
            raise ValueError("WorkerSpec.rdzv_handler is required to run an agent (the spec has None)")
        self._worker_group = WorkerGroup(spec)
        self._remaining_restarts = spec.max_restarts
        #: When a restart was spent before its cause was known: the end of the grace within
        #: which a member of the round left may still show as lost (see _settle_spent_restart).
        self._settle_by: float | None = None
        self._checkpoint_ring = checkpoint_ring
        self._workers_started = time.monotonic()  # of the current workers
        #: While nodes wait to join and the group finishes its current checkpoint interval.
        self._join_at_checkpoint = (
            None if checkpoint_commits is None else JoinAtCheckpoint(checkpoint_commits)
        )
        self._group_restart_count = 0  # of the last round (see RankAssignment)
        self._oom = OomWatch()  # whether a failed worker was killed at the container's memory limit
        self._store: Store | None = None
        self._exit_barrier_timeout = exit_barrier_timeout
        self._membership_grace_override = membership_grace
        #: Set on a signal: the node leaves its round as soon as its workers are stopped.
        self._leave_once_stopped = False
        self._event_sink: EventSink = event_sink if event_sink is not None else default_sink()
        self.metrics = metrics if metrics is not None else Metrics()
        self._total_execution_time = 0.0
        self._attempt = -1  # bumped on every start, restarts of either kind included
        self._stopping: OverlappedStop | KeptWorkers = OverlappedStop(lambda: None, lambda *_: None, False)
        self._keep_allowed = False  # may this restart keep the workers (kelastic.agent.keep)

    # subclass interface -----------------------------------------------------------
    @abc.abstractmethod
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]: ...

    @abc.abstractmethod
    def _stop_workers(self, worker_group: WorkerGroup) -> None: ...

    @abc.abstractmethod
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult: ...

    @abc.abstractmethod
    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM) -> None: ...

    def _on_rendezvous(self, worker_group: WorkerGroup) -> None:
        """Called after each completed rendezvous, before workers start."""

    def _on_monitor_tick(self, worker_group: WorkerGroup) -> None:
        """Called on every turn of the monitor loop while workers run."""

    def _step_aside(self, worker_group: WorkerGroup) -> str | None:
        """Called on healthy ticks: the reason this node just left its round to make room
        (a straggler replaced by a standby), or None to go on. Default: never."""
        return None

    def _after_exit_barrier(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        """Called once the workers succeeded and the exit barrier is over; returns the run's
        final result. Workers still held alive (they returned but have not exited) are
        released here and waited for."""
        return result

    # public -----------------------------------------------------------------------
    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    @property
    def restarts_spent(self) -> int:
        """Restarts this agent spent of its own ``max_restarts`` budget."""
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    @property
    def restart_count(self) -> int:
        """The worker group's restart count: ``TORCHELASTIC_RESTART_COUNT`` of the current workers.

        The most restarts any agent of the current round had spent when it formed
        (the same on every agent of the round), and never less than this agent's own.
        """
        return max(self.restarts_spent, self._group_restart_count)

    @property
    def attempt(self) -> int:
        """How many times workers were started before the current start (0-based)."""
        return self._attempt

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        start = time.monotonic()
        shutdown_called = False
        try:
            result = self._invoke_run()
            self._total_execution_time = time.monotonic() - start
            self._record_worker_events(result)
            self._event(
                "kelastic.agent.succeeded" if not result.is_failed() else "kelastic.agent.failed",
                state=result.state.value,
                total_run_time=round(self._total_execution_time, 3),
            )
            return result
        except RendezvousGracefulExitError as e:
            _log.info("rendezvous exited gracefully: %s", e)
            return RunResult(state=WorkerState.SUCCEEDED)
        except SignalException as e:
            if WorkerState.is_running(self._worker_group.state):  # else the agent says what it waited for
                _log.warning("agent received %s, stopping workers with it", signal.Signals(e.sigval).name)
            _announce_leaving(self._worker_group.spec.rdzv_handler)
            self._event("kelastic.agent.signal", signal=signal.Signals(e.sigval).name)
            self._leave_once_stopped = True
            self._shutdown(e.sigval)
            shutdown_called = True
            raise
        finally:
            if not shutdown_called:
                self._shutdown()
            self._total_execution_time = time.monotonic() - start

    def get_event_failed(self) -> Event:
        """The agent's FAILED event (torch's API), with the exception being handled, if any,
        as ``raw_error``; building it records nothing."""
        return self._agent_event("FAILED", raw_error=traceback.format_exc())

    def get_event_succeeded(self) -> Event:
        """The agent's SUCCEEDED event (torch's API); building it records nothing."""
        return self._agent_event("SUCCEEDED")

    def _agent_event(self, state: str, raw_error: str | None = None) -> Event:
        return _final_event(
            self._worker_group, self._agent_metadata(), state, raw_error,
            total_run_time=self._total_execution_time, restarts=self.restarts_spent,
        )  # fmt: skip

    # the algorithm --------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        spec = worker_group.spec
        handler = spec.rdzv_handler
        with self.metrics.timer("agent", "rendezvous"):
            info = handler.next_rendezvous()
        # Before the restarts this agent spent are exchanged with its peers.
        self._settle_spent_restart(handler)
        store, group_rank, group_world_size = info.store, info.rank, info.world_size
        boot = info.bootstrap_store_info
        master_addr = spec.master_addr or (boot.master_addr if boot is not None else None)
        master_port = spec.master_port or (boot.master_port if boot is not None else None)
        if master_addr is None or master_port is None:
            raise RuntimeError(
                f"rendezvous backend {spec.rdzv_handler.get_backend()!r} gave no master address/port; "
                "pass --master-addr and --master-port"
            )
        self._store = store
        with self.metrics.timer("agent", "assign_ranks"):
            assignment = exchange_rank_assignments(
                store,
                group_rank,
                group_world_size,
                spec.role,
                spec.local_world_size,
                abort=self._membership_changed_now if self._watches_membership() else None,
                restarts=self.restarts_spent,
                endpoint=self._checkpoint_ring.endpoint if self._checkpoint_ring is not None else "",
                signer=handler.round_signer() if isinstance(handler, SignedRecords) else None,
            )
        # The ranks were exchanged while the old workers stopped; they are gone before the
        # checkpoint ring changes and the new workers start (kelastic.agent.reform).
        self._stopping.wait()
        if self._checkpoint_ring is not None:
            # The ring a commit replicates on: this round's, learnt here, never from a request.
            self._checkpoint_ring.set_ring(assignment.ring)
        self._group_restart_count = assignment.group_restart_count
        worker_group.workers = workers_for(assignment, spec.local_world_size)
        worker_group.store = store
        worker_group.group_rank = group_rank
        worker_group.group_world_size = group_world_size
        worker_group.master_addr = master_addr
        worker_group.master_port = int(master_port)
        self._event(
            "kelastic.agent.rendezvous",
            **_timings_metadata(handler),
            group_rank=group_rank,
            group_world_size=group_world_size,
            world_size=assignment.global_world_size,
            base_global_rank=assignment.base_global_rank,
            master_addr=master_addr,
            master_port=int(master_port),
            restart_count=self.restart_count,
        )
        ranks = [w.global_rank for w in worker_group.workers]
        _log.info(
            "[%s] node %d/%d: ranks %s of %d, master %s:%s, restarts %d",
            spec.role,
            group_rank,
            group_world_size,
            f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else ranks[0] if ranks else "none",
            assignment.global_world_size,
            master_addr,
            master_port,
            self.restart_count,
        )

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        while True:
            try:
                self._rendezvous(worker_group)
                break
            except MembershipChangedError as e:  # a peer left mid-setup: form the group again
                _log.info("[%s] %s; rendezvous again", worker_group.spec.role, e)
                self.metrics.incr("agent", "membership_restarts")
        self._on_rendezvous(worker_group)
        self._attempt += 1
        with self.metrics.timer("agent", "start_workers"):
            ids = self._start_workers(worker_group)
        for local_rank, wid in ids.items():
            worker = worker_group.workers[local_rank]
            worker.id = wid
        self._event(
            "kelastic.agent.workers_started",
            attempt=self._attempt,
            pids=json.dumps({str(k): v for k, v in ids.items()}, default=str),
        )
        worker_group.state = WorkerState.HEALTHY
        self._workers_started = time.monotonic()

    def _restart_workers(self, worker_group: WorkerGroup, reason: str) -> None:
        _log.info("[%s] restarting workers: %s", worker_group.spec.role, reason)
        self._event("kelastic.agent.restart", reason=reason, restart_count=self.restart_count)
        # The old workers stop (or park) while this node joins the next round (.reform, .keep).
        self._stopping = self._begin_stop(worker_group)
        worker_group.state = WorkerState.STOPPED
        try:
            self._initialize_workers(worker_group)
        finally:
            self._stopping.wait()

    def _begin_stop(self, worker_group: WorkerGroup) -> OverlappedStop | KeptWorkers:
        """Start a restart's stop of the workers, beside the join (the local agent may keep them)."""
        return OverlappedStop(lambda: self._stop_workers(worker_group), self._workers_stopped)

    def _workers_stopped(self, seconds: float, ended: float) -> None:
        self.metrics.observe("agent", "stop_workers", seconds)
        self._event("kelastic.agent.workers_stopped", seconds=round(seconds, 3), stopped_at=ended)

    def _leave_round(self) -> None:
        """After a signal, once the workers are stopped (see :func:`_leave_now`)."""
        _leave_now(self._worker_group.spec.rdzv_handler)

    def _watcher(self) -> MembershipWatcher | None:
        """The rendezvous handler, if it can watch the membership (see :class:`MembershipWatcher`)."""
        handler = self._worker_group.spec.rdzv_handler
        return handler if isinstance(handler, MembershipWatcher) else None

    def _watches_membership(self) -> bool:
        return self._watcher() is not None

    def _wait_for_membership_change(self, timeout: float) -> bool:
        """Block up to ``timeout`` s; True if the rendezvous membership changed meanwhile."""
        watcher = self._watcher()
        if watcher is not None:
            return bool(watcher.wait_membership_change(timeout))
        time.sleep(timeout)
        return False

    def _membership_changed_now(self) -> bool:
        watcher = self._watcher()
        return watcher is not None and bool(watcher.membership_changed())

    @property
    def _membership_grace(self) -> float:
        # Asked at each failure, not once: a handler knows how fast it sees a loss only once connected.
        if self._membership_grace_override is not None:
            return self._membership_grace_override
        handler = self._worker_group.spec.rdzv_handler
        return _default_grace(handler, final=self._remaining_restarts == 0)

    def _watching(self) -> Watching:
        watcher = self._watcher()
        if watcher is None:
            return Watching.NOTHING
        return Watching.LOSSES if isinstance(watcher, LossWatcher) else Watching.MEMBERSHIP

    def _loss_question(self, watching: Watching, changed: bool) -> LossQuestion:
        alone = self._worker_group.group_world_size == 1  # no peer whose loss could have caused it
        return restart_policy.loss_question(
            watching, changed=changed, alone=alone, final=self._remaining_restarts == 0
        )

    def _member_lost(self, question: LossQuestion) -> bool:
        """After workers failed: was it caused by the group changing around them?

        Asks the handler ``question`` (see :func:`~kelastic.agent.restart_policy.loss_question`),
        waiting up to the membership grace for the answer, except for
        :attr:`LossQuestion.AFTER_REJOIN`, which takes what is known now: the rest of
        the answer comes after the restart (:meth:`_settle_spent_restart`).
        """
        if question is LossQuestion.NO or question is LossQuestion.YES:
            return question is LossQuestion.YES
        watcher = self._watcher()
        assert watcher is not None  # a question to ask means a handler that watches
        if question is LossQuestion.AFTER_REJOIN:
            assert isinstance(watcher, LossWatcher)
            return bool(watcher.wait_member_lost(0.0))
        if question is LossQuestion.WAIT_MEMBER_LOST:
            assert isinstance(watcher, LossWatcher)
            return bool(watcher.wait_member_lost(self._membership_grace))
        return watcher.membership_changed() or bool(watcher.wait_membership_change(self._membership_grace))

    def _at_a_checkpoint(self, verdict: Verdict, tick: float) -> Verdict:
        """Hold a restart for joining nodes until the group's next checkpoint is committed
        (:class:`~kelastic.agent.join_at_checkpoint.JoinAtCheckpoint`); at once when a member
        was lost."""
        joining, watcher = self._join_at_checkpoint, self._worker_group.spec.rdzv_handler
        if joining is None or not isinstance(watcher, LossWatcher):
            return verdict
        # A member lost, or one that re-joined the next round (its workers failed): the round
        # commits no checkpoint any more, so waiting for one would wait for nothing.
        if watcher.wait_member_lost(0.0) or (isinstance(watcher, RoundWatcher) and watcher.round_over()):
            joining.cancel()
            return verdict
        spec = self._worker_group.spec
        return joining.hold(verdict, tick, role=spec.role, workers_started=self._workers_started)

    def _settle_spent_restart(self, handler: RendezvousHandler) -> None:
        """After re-joining on a restart spent before its cause was known: give it back
        when the round left lost a member (its peers' workers failed because of it)."""
        deadline, self._settle_by = self._settle_by, None
        if deadline is None or not isinstance(handler, LossWatcher):
            return
        if handler.wait_previous_round_lost(max(0.0, deadline - time.monotonic())):
            self._remaining_restarts += 1
            self.metrics.incr("agent", "restarts", -1)
            self.metrics.incr("agent", "membership_restarts")
            _log.info(
                "[%s] a member of the last round was lost: restart given back (%d/%d left)",
                self._worker_group.spec.role,
                self._remaining_restarts,
                self._worker_group.spec.max_restarts,
            )

    def _apply(self, verdict: Verdict) -> bool:
        """Carry ``verdict`` out; True when the agent's run ends with it (FAIL)."""
        wg = self._worker_group
        if verdict.action is Action.RESTART_FREE:
            self.metrics.incr("agent", "membership_restarts")
            self._restart_workers(wg, verdict.reason)
        elif verdict.action is Action.RESTART_SPEND:
            self._remaining_restarts -= 1
            self.metrics.incr("agent", "restarts")
            self._restart_workers(wg, verdict.reason)
        elif verdict.action is Action.FAIL:
            self._stop_workers(wg)
            wg.state = WorkerState.FAILED
            return True
        return False

    def _invoke_run(self) -> RunResult:
        spec = self._worker_group.spec
        handler = spec.rdzv_handler
        _log.info("[%s] starting workers for entrypoint %s", spec.role, spec.get_entrypoint_name())
        self._initialize_workers(self._worker_group)
        watching = self._watching()
        while True:
            changed = self._wait_for_membership_change(spec.monitor_interval)
            result = self._monitor_workers(self._worker_group)
            state = result.state
            self._worker_group.state = state
            self._keep_allowed = state is not WorkerState.UNHEALTHY  # never hung workers
            self.metrics.put(f"workers.{spec.role}", "remaining_restarts", self._remaining_restarts)

            if state == WorkerState.SUCCEEDED:
                _log.info(
                    "[%s] workers finished; waiting up to %.0fs for the other agents",
                    spec.role,
                    self._exit_barrier_timeout,
                )
                self._exit_barrier()
                return self._after_exit_barrier(self._worker_group, result)
            if state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                self._event("kelastic.agent.fault_noticed", cause="workers_" + state.value.lower())
                # Failed while waiting for a checkpoint to let nodes join: a peer that re-formed first
                # stopped them (or they failed on their own meanwhile); the group is re-forming.
                deferring = self._join_at_checkpoint is not None and self._join_at_checkpoint.active
                question = LossQuestion.YES if deferring else self._loss_question(watching, changed)
                if self._join_at_checkpoint is not None:
                    self._join_at_checkpoint.cancel()
                grace_ends = time.monotonic() + self._membership_grace
                verdict = restart_policy.decide_after_failure(
                    restart_policy.Failure(
                        state=state.value,
                        member_lost=self._member_lost(question),
                        remaining_restarts=self._remaining_restarts,
                        max_restarts=spec.max_restarts,
                        settled=question is not LossQuestion.AFTER_REJOIN,
                        cause=self._oom.cause({rank: f.exitcode for rank, f in result.failures.items()}),
                    )
                )
                if question is LossQuestion.AFTER_REJOIN and verdict.action is Action.RESTART_SPEND:
                    self._settle_by = grace_ends
            elif state == WorkerState.HEALTHY:
                self._on_monitor_tick(self._worker_group)
                aside = self._step_aside(self._worker_group)
                # only a handler that watches nothing is asked (torch's c10d and static)
                waiting = handler.num_nodes_waiting() if watching is Watching.NOTHING else 0
                verdict = restart_policy.decide_while_healthy(
                    restart_policy.Healthy(watching=watching, changed=changed, nodes_waiting=waiting)
                )
                if aside is not None:  # this node left its round: re-join (as a standby)
                    verdict = Verdict(Action.RESTART_FREE, aside)
                    self._keep_allowed = False  # a standby has no workers to keep
                    _leave_ring(self._checkpoint_ring)
                elif verdict.action is Action.RESTART_FREE and watching is Watching.LOSSES:
                    verdict = self._at_a_checkpoint(verdict, spec.monitor_interval)
            else:
                raise RuntimeError(f"[{spec.role}] worker group in unexpected state {state.value}")
            if state == WorkerState.HEALTHY and verdict.action is not Action.CONTINUE:
                self._event("kelastic.agent.fault_noticed", cause="membership")
            if self._apply(verdict):
                return result

    def _exit_barrier(self) -> None:
        wg = self._worker_group
        handler = wg.spec.rdzv_handler
        if self._store is None or wg.group_world_size is None:
            return
        start = time.monotonic()
        try:
            if isinstance(handler, FinishBarrier):
                ok = handler.wait_all_finished(self._exit_barrier_timeout)
            else:
                ok = exit_barrier(self._store, wg.group_world_size, self._exit_barrier_timeout)
            if ok:
                _log.info("all agents done after %.2fs at the exit barrier", time.monotonic() - start)
            else:
                _log.warning(
                    "exit barrier: not all %d agents finished (one was lost, or %.0fs passed); exiting anyway",
                    wg.group_world_size,
                    self._exit_barrier_timeout,
                )
        except SignalException:
            raise
        except Exception as e:  # the job is done; a store gone at exit must not turn success into failure
            _log.warning("exit barrier failed after %.2fs: %s", time.monotonic() - start, e)

    # events -------------------------------------------------------------------------
    def _agent_metadata(self) -> dict[str, Any]:
        """What every agent event says about the agent."""
        wg = self._worker_group
        spec = wg.spec
        return {
            "run_id": spec.rdzv_handler.get_run_id(),
            "role": spec.role,
            "group_rank": wg.group_rank,
            "hostname": socket.gethostname(),
            "rdzv_backend": spec.rdzv_handler.get_backend(),
        }

    def _event(self, name: str, **metadata: Any) -> None:
        md = self._agent_metadata()
        md.update(metadata)
        record(Event(name=name, source=EventSource.AGENT, metadata=md), self._event_sink)

    def _record_worker_events(self, result: RunResult) -> None:
        wg = self._worker_group
        for worker in wg.workers:
            failure = result.failures.get(worker.global_rank)
            state = result.state.value if failure is None else WorkerState.FAILED.value
            md: dict[str, Any] = {
                "run_id": wg.spec.rdzv_handler.get_run_id(),
                "role": wg.spec.role,
                "global_rank": worker.global_rank,
                "local_rank": worker.local_rank,
                "group_rank": wg.group_rank,
                "worker_id": str(worker.id),
                "state": state,
                "restart_count": self.restart_count,
                "raw_error": None,
                "exitcode": None,
            }
            if failure is not None:
                md["exitcode"] = failure.exitcode
                md["raw_error"] = json.dumps(failure.error_file_data) if failure.error_file_data else None
            record(
                Event(name=f"kelastic.worker.{state}", source=EventSource.WORKER, metadata=md),
                self._event_sink,
            )
