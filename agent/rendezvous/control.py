"""The controller protocol: how an operator steers and observes a kelastic rendezvous.

The controller (kelastic's operator) is a client of the same store as the agents
(``kelastic-rendezvous``). It uses four calls; all keys are under
``kelastic/<run_id>/`` (layout in ``protocol``):

``publish_membership(store, run_id, nodes=..., min_nodes=..., max_nodes=...)``
    ``nodes`` are the names (pod names, which agents use as ``KELASTIC_NODE_NAME``)
    of the nodes the controller considers alive and runnable now. List pods that
    are running, not only ready ones: an agent is ready only after it joined. It
    writes ``ctl/membership`` and, if that changed, pushes an event. From then on:

    - a node that is not listed does not join; it waits until it is listed (or its
      ``join_timeout`` expires);
    - the open round closes as soon as every listed node has joined (and at least
      ``min_nodes``), with no last-call wait; ``max_nodes`` still caps the round;
    - a member of the current round that is not listed is dropped at once (fate
      ``dropped``): the other members see ``membership_changed()`` and re-form
      without it, without waiting for its heartbeat to stop.

    Calling it again with the same arguments is cheap and changes nothing, so the
    operator may call it on every reconcile.

``read_status(store, run_id) -> RendezvousStatus``
    The current (latest closed) round, its members, how many nodes wait in the
    open round, the listed nodes parked as standbys (``standby/<name>``, read for
    the listed nodes that are no members), whether the job is closed, the highest restart count an agent
    reported, and the job's progress: the minimum step over the current members
    that reported one.

``publish_progress(store, run_id, node, step=..., total=..., restarts=...)``
    Called by agents (at most about once a second) with their workers' progress
    and ``TORCHELASTIC_RESTART_COUNT``; also ``local_world_size`` so that
    ``read_status`` can count ranks rather than nodes (agents may instead pass
    ``local_world_size`` in their rdzv-conf, which records it when they join).
    ``recovery`` (optional) is the node's latest recovery: how long it took from the
    agent deciding to restart its workers (a peer lost or joined, workers failed) to
    the next round closing, and when that round closed; ``read_status`` lists the
    current members' recoveries so the operator can count them. ``hang`` (optional)
    is the node's latest hang verdict (``kelastic.agent.hang``): the global ranks
    that made no progress, for how long, and when; ``read_status`` lists the
    current members' verdicts so the operator can name the stalled ranks.
    ``failure`` (optional) is the reason of the node's latest restart after a failure
    (``"workers FAILED (rank 1 was OOM-killed ...); ..."``, :mod:`kelastic.agent.oom`) and
    when its group re-formed; ``read_status`` lists the current members' so the operator
    can say why the group restarted.
    ``checkpoint`` (optional) is the node's view of the memory checkpoint
    (``kelastic.checkpoint``), a JSON object: ``latest`` (the newest complete
    checkpoint id it knows, or null), ``step`` (the training step saved with it, or
    null), ``restored`` (its latest restore: ``{"id", "source": "memory" | "replica" |
    "durable", "seconds", "time"}``, or null), ``bytes`` (what it holds) and ``limit``;
    ``read_status`` lists the current members' records as they were written, and
    readers tolerate missing or extra keys. ``goodput`` (optional) is the node's goodput
    record (``kelastic.agent.goodput``), a JSON object: ``time`` (when it was made),
    ``started`` (when its agent started), ``step`` and ``step_time`` (its slowest rank's step and when it reached it), ``step_seconds``
    (its fault-free step time), ``stall`` (seconds its workers waited on saves) and
    ``resumes`` (its latest restarts: ``[stopped step, stopped time, first step, first
    time]`` each); ``read_status`` lists the current members' records as written.

``publish_straggler(store, run_id, record)`` / ``read_straggler(store, run_id)``
    The group's straggler verdict (:mod:`kelastic.agent.straggler_watch`), written by the
    agent of group rank 0: a JSON object with ``node`` (the straggler, or null once
    there is none), ``round``, ``ratio`` (its work per step over the others' median),
    ``since`` (when it became slowest), ``declared``, ``policy`` (``Report`` or
    ``Replace``) and ``action`` (``report``, ``replace``: it steps aside at the next
    checkpoint, ``replaced``: it did). ``read_status`` returns it as ``straggler``.

``signer`` (a :class:`~.records.RecordSigner` of the job's key, as
``RecordSigner.for_job(job_key)`` makes it): the progress reports and the straggler verdict
are written with the job's MAC over their key's name (the run, the node) and their value
(which names the round and the time it was made), and read only with a valid one: a record a
stranger wrote is counted and ignored, as if absent, so it neither moves the job's status nor
gets a member swapped out. Without a signer they are written unsigned and read as their text
before any MAC (an operator that does not hold the job's key).

``connect(endpoint, timeout)`` opens a client of the store and raises an error
naming the endpoint if it is unreachable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from kelastic.agent.contract import DEFAULT_RDZV_PORT

from .memberrecords import member_value, read_members, read_standby
from .protocol import (
    ControllerBounds,
    ControllerMembership,
    Fate,
    RunKeys,
    claim_fate,
    connect_store,
    get_or_none,
    open_round,
    parse_endpoint,
    push_event,
    read_bounds,
    read_counter,
    read_membership,
    read_optional,
)
from .records import MARK, RecordSigner

__all__ = [
    "AgentReport",
    "Failure",
    "Hang",
    "JobProgress",
    "Recovery",
    "RendezvousStatus",
    "agents_hold",
    "connect",
    "job_progress",
    "job_signer",
    "publish_membership",
    "publish_progress",
    "publish_straggler",
    "read_progress",
    "read_status",
    "read_straggler",
]

#: The claimer recorded on fates the controller decides (its value is
#: ``protocol.CONTROLLER_DROPPED``, signed with the job's key when the controller has it).
CONTROLLER = "controller"


@dataclass(frozen=True)
class JobProgress:
    """Progress of the job: the slowest current member's step."""

    step: int
    total: int | None
    fraction: float | None  # step / total when total is known


@dataclass(frozen=True)
class Recovery:
    """One node's recovery: ``seconds`` from the restart decision to the next round closing at ``ended``
    (seconds since the epoch)."""

    node: str
    seconds: float
    ended: float


@dataclass(frozen=True)
class Hang:
    """One node's hang verdict: ``ranks`` (global) without progress for ``seconds``, judged at ``at``."""

    node: str
    ranks: tuple[int, ...]
    seconds: float
    at: float


#: The longest failure reason a report keeps (characters): a reason is one line of the agent's.
MAX_FAILURE_REASON = 500


@dataclass(frozen=True)
class Failure:
    """One node's latest restart after a failure: its ``reason`` as the agent logged it
    (``"workers FAILED (rank 1 was OOM-killed ...); 2/3 restarts left after this"``), and
    ``at`` (seconds since the epoch) when the group re-formed after it."""

    node: str
    reason: str
    at: float


@dataclass(frozen=True)
class AgentReport:
    """One agent's latest report as ``publish_progress`` stored it; ``step`` is None until its
    workers report a step. (The agent computes its step with
    :class:`kelastic.agent.progress.NodeProgress`, the minimum over its local ranks.)"""

    node: str
    step: int | None
    total: int | None
    restarts: int
    local_world_size: int | None
    time: float
    recovery: Recovery | None = None
    hang: Hang | None = None
    #: The reason of the node's latest restart after a failure, and when its group re-formed.
    failure: Failure | None = None
    #: The node's checkpoint record as published (see ``publish_progress``), None without one.
    checkpoint: Mapping[str, object] | None = None
    #: The node's goodput record as published (see ``publish_progress``), None without one.
    goodput: Mapping[str, object] | None = None


@dataclass(frozen=True)
class RendezvousStatus:
    round: int  # latest closed round (0: none yet)
    world_size: int  # ranks: sum of the members' local_world_size (1 for a member that reported none)
    members: tuple[str, ...]  # node names by group rank
    waiting: int  # nodes in the open round (re-joining members included)
    closed: bool  # the job is finished (set_closed)
    restarts: int  # highest TORCHELASTIC_RESTART_COUNT an agent reported
    progress: JobProgress | None
    recoveries: tuple[Recovery, ...] = ()  # the current members' latest recoveries
    hangs: tuple[Hang, ...] = ()  # the current members' latest hang verdicts
    failures: tuple[Failure, ...] = ()  # the current members' latest restarts after a failure
    #: The current members' checkpoint records, (node, record).
    checkpoints: tuple[tuple[str, Mapping[str, object]], ...] = ()
    #: Listed nodes that wait as standbys, without a slot (``standby/<name>``), by name.
    standbys: tuple[str, ...] = ()
    #: The current members' goodput records, (node, record).
    goodputs: tuple[tuple[str, Mapping[str, object]], ...] = ()
    #: The group's straggler verdict as published (``publish_straggler``), None without one.
    straggler: Mapping[str, object] | None = None
    #: Nodes parked for the open round (standbys), listed or not (``r/<open>/parked``).
    parked: int = 0


def connect(endpoint: str, timeout: float = 5.0) -> dist.Store:
    """A client of the rendezvous store at ``host[:port]``.

    Raises ValueError for a malformed endpoint and RendezvousConnectionError
    naming the endpoint when it is not reachable within ``timeout`` seconds.
    """
    host, port = parse_endpoint(endpoint, DEFAULT_RDZV_PORT)
    return connect_store(host, port, timeout)


def publish_membership(
    store: dist.Store,
    run_id: str,
    *,
    nodes: Sequence[str],
    min_nodes: int,
    max_nodes: int,
    job_key: bytes | None = None,
) -> None:
    """Publish the nodes the controller considers alive and the size bounds (see module doc).

    ``job_key``: the job's secret (as its agents read it from ``--job-secret-file``): every
    record written (``ctl/...``, the ``dropped`` fates, the event) then carries its MAC
    (:mod:`.records`), which agents that run ``controlled=1`` with the secret require. Without
    it the records are unsigned, for agents without a secret (or not ``controlled``).
    """
    names = tuple(nodes)
    if isinstance(nodes, str) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"nodes must be a sequence of non-empty node names, got {nodes!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"nodes lists a name twice: {sorted(names)}")
    if min_nodes < 1 or max_nodes < min_nodes:
        raise ValueError(
            f"need 1 <= min_nodes <= max_nodes, got min_nodes={min_nodes}, max_nodes={max_nodes}"
        )
    # controlled: read back only what carries the job's MAC (a stranger's record is redone).
    keys = RunKeys(run_id, RecordSigner.for_job(job_key), controlled=job_key is not None)
    wanted = ControllerMembership(names, min_nodes, max_nodes)
    bounds = ControllerBounds(min_nodes, max_nodes, len(names))
    previous = read_membership(store, keys)
    if previous != wanted or read_bounds(store, keys) != bounds:
        # Agents read only their own ``ctl/listed/<name>`` and the small bounds (O(1)
        # per node); the full list is for the few that decide a close. Only the
        # difference is written, and the full list last, so that a publication cut
        # short is redone by the next call.
        before = set(previous.nodes) if previous is not None else set()
        for name in names:
            if name not in before:
                store.set(keys.listed(name), keys.sign(keys.listed(name), "1"))
        for name in before - set(names):
            store.delete_key(keys.listed(name))
        store.set(keys.bounds, keys.sign(keys.bounds, bounds.to_json()))
        store.set(keys.membership, keys.sign(keys.membership, wanted.to_json()))
        push_event(store, keys, "membership")
    # Checked on every call, not only on a change: the current round may have closed
    # after the previous publication with a member that is no longer listed.
    current = open_round(store, keys) - 1
    listed = set(names)
    for member in _members(store, keys, current):
        if member not in listed:
            claim_fate(store, keys, current, member, Fate.DROPPED, CONTROLLER)


def agents_hold(store: dist.Store, run_id: str, job_key: bytes) -> bool | None:
    """Whether the job's agents sign with ``job_key``: the MAC of the latest round's close (its
    ``size``, written by an agent) holds under it; None before a round closed. Counts and logs
    nothing (a close without that MAC is what agents with another secret write)."""
    keys = RunKeys(run_id, RecordSigner.for_job(job_key))
    r = read_counter(store, keys.open)  # the count as is: which key signed its round's close
    stored = get_or_none(store, keys.size(r)) if r >= 1 else None
    return None if stored is None else keys.signer.holds(keys.name(keys.size(r)), stored)


def publish_progress(
    store: dist.Store,
    run_id: str,
    node: str,
    *,
    step: int | None,
    total: int | None,
    restarts: int,
    local_world_size: int | None = None,
    recovery: tuple[float, float] | None = None,
    failure: tuple[str, float] | None = None,
    hang: tuple[tuple[int, ...], float, float] | None = None,
    checkpoint: Mapping[str, object] | None = None,
    goodput: Mapping[str, object] | None = None,
    signer: RecordSigner | None = None,
    round_: int | None = None,
) -> None:
    """Record ``node``'s latest progress (overwrites its previous report), signed by ``signer``.

    ``round_``: the rendezvous round the node is a member of, under the MAC with the rest, so
    that a reader of round R takes no report signed in another round (a replay; see
    :func:`read_progress`).

    ``checkpoint`` is the node's memory checkpoint state (``CheckpointKeeper.status``:
    latest, step, restored, bytes, limit), published as is under ``"checkpoint"``.

    ``step`` is None for a node whose workers have not reported a step yet (a node
    that just joined): it then counts for restarts and size but not for progress.
    """
    report: dict[str, object] = {
        "step": None if step is None else int(step),
        "total": None if total is None else int(total),
        "restarts": int(restarts),
        "local_world_size": None if local_world_size is None else int(local_world_size),
        "time": time.time(),
        "round": None if round_ is None else int(round_),
    }
    if recovery is not None:  # (seconds, when the round closed)
        report["recovery"] = [float(recovery[0]), float(recovery[1])]
    if failure is not None:  # (the restart's reason, when the group re-formed after it)
        report["failure"] = [str(failure[0])[:MAX_FAILURE_REASON], float(failure[1])]
    if hang is not None:  # (global ranks, seconds without progress, when)
        report["hang"] = [[int(r) for r in hang[0]], float(hang[1]), float(hang[2])]
    if checkpoint is not None:  # the node's checkpoint record (see the module doc)
        report["checkpoint"] = dict(checkpoint)
    if goodput is not None:  # the node's goodput record (see the module doc)
        report["goodput"] = dict(goodput)
    keys = _keys(run_id, signer)
    store.set(keys.progress(node), keys.sign(keys.progress(node), json.dumps(report)))


def read_progress(
    store: dist.Store, run_id: str, node: str, signer: RecordSigner | None = None, round_: int | None = None
) -> AgentReport | None:
    """``node``'s latest report; None without one, or one ``signer`` finds not signed by the job.

    ``round_`` (with a signing ``signer``): the round whose members' reports are read; a report
    the job signed in another round (the node's report of an earlier round written back by
    someone who can reach the store, or one not re-published since the round changed) is
    none either; counted as a refused record where it is older than a report the signer took
    from the node before (``RecordSigner.other_round``)."""
    keys = _keys(run_id, signer)
    raw = member_value(keys, keys.progress(node), read_optional(store, keys.progress(node)))
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if signer is not None and signer.signing and round_ is not None:
        if data.get("round") != round_:
            signer.other_round(keys.progress(node), data.get("round"), round_)
            return None
        signer.took(keys.progress(node), round_)
    rec = data.get("recovery")
    hung = data.get("hang")
    failed = data.get("failure")
    return AgentReport(
        node=node,
        step=None if data.get("step") is None else int(data["step"]),
        total=data.get("total"),
        restarts=int(data.get("restarts", 0)),
        local_world_size=data.get("local_world_size"),
        time=float(data.get("time", 0.0)),
        recovery=Recovery(node, float(rec[0]), float(rec[1])) if rec else None,
        hang=Hang(node, tuple(int(r) for r in hung[0]), float(hung[1]), float(hung[2])) if hung else None,
        failure=Failure(node, str(failed[0]), float(failed[1])) if failed else None,
        checkpoint=data["checkpoint"] if isinstance(data.get("checkpoint"), dict) else None,
        goodput=data["goodput"] if isinstance(data.get("goodput"), dict) else None,
    )


def job_progress(reports: Sequence[AgentReport]) -> JobProgress | None:
    """The slowest reported step; ``total`` is the largest total reported.

    Nodes without a step yet are left out, so a node joining a running job does not
    pull the job's progress back to 0 until its workers resume from the checkpoint.
    """
    steps = [r.step for r in reports if r.step is not None]
    if not steps:
        return None
    step = min(steps)
    totals = [r.total for r in reports if r.total]
    total = max(totals) if totals else None
    return JobProgress(step=step, total=total, fraction=None if total is None else min(1.0, step / total))


def read_status(store: dist.Store, run_id: str, signer: RecordSigner | None = None) -> RendezvousStatus:
    """A snapshot of the run (see ``RendezvousStatus``); with ``signer``, from the records the
    job signed only (members, standbys, reports, the straggler verdict)."""
    keys = _keys(run_id, signer)
    opened = open_round(store, keys)
    current = opened - 1
    members = _members(store, keys, current)
    reports = [
        p for p in (read_progress(store, run_id, m, signer, current) for m in members) if p is not None
    ]
    by_node = {r.node: r for r in reports}
    joined_with = _local_world_sizes(store, keys, current, len(members))
    world_size = sum(
        (by_node[m].local_world_size if m in by_node else None) or joined_with[i] or 1
        for i, m in enumerate(members)
    )
    return RendezvousStatus(
        round=current,
        world_size=world_size,
        members=tuple(members),
        waiting=read_counter(store, keys.joined(opened)),
        closed=bool(store.check([keys.closed])),
        restarts=max((r.restarts for r in reports), default=0),
        progress=job_progress(reports),
        recoveries=tuple(r.recovery for r in reports if r.recovery is not None),
        hangs=tuple(r.hang for r in reports if r.hang is not None),
        failures=tuple(r.failure for r in reports if r.failure is not None),
        checkpoints=tuple((r.node, r.checkpoint) for r in reports if r.checkpoint is not None),
        standbys=_standbys(store, keys, members),
        goodputs=tuple((r.node, r.goodput) for r in reports if r.goodput is not None),
        straggler=read_straggler(store, run_id, signer),
        parked=read_counter(store, keys.parked(opened)),
    )


def publish_straggler(
    store: dist.Store, run_id: str, record: Mapping[str, object], signer: RecordSigner | None = None
) -> None:
    """Record the group's straggler verdict (overwrites the previous one; see the module doc)."""
    keys = _keys(run_id, signer)
    store.set(keys.straggler(), keys.sign(keys.straggler(), json.dumps(dict(record))))


def read_straggler(
    store: dist.Store, run_id: str, signer: RecordSigner | None = None
) -> Mapping[str, object] | None:
    """The group's straggler verdict, or None without one (or an unreadable one, or one
    ``signer`` finds not signed by the job)."""
    keys = _keys(run_id, signer)
    raw = member_value(keys, keys.straggler(), read_optional(store, keys.straggler()))
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def job_signer(job_key: bytes) -> RecordSigner:
    """The signer of a job's records under its secret ``job_key``, for the ``signer`` arguments:
    keep one per job, so that the records it refuses are logged at its rate, not at every read."""
    return RecordSigner.for_job(job_key)


def _keys(run_id: str, signer: RecordSigner | None) -> RunKeys:
    return RunKeys(run_id) if signer is None else RunKeys(run_id, signer)


def _standbys(store: dist.Store, keys: RunKeys, members: Sequence[str]) -> tuple[str, ...]:
    """The listed nodes that are no members and wait as standbys (O(listed - members) reads)."""
    membership = read_membership(store, keys)
    if membership is None:
        return ()
    others = sorted(set(membership.nodes) - set(members))
    return tuple(name for name in others if read_standby(store, keys, name) is not None)


def _members(store: dist.Store, keys: RunKeys, r: int) -> list[str]:
    if r < 1:
        return []
    return read_members(store, keys, r) or []


def _local_world_sizes(store: dist.Store, keys: RunKeys, r: int, size: int) -> list[int | None]:
    """``local_world_size`` each member of round r joined with (its rdzv-conf), by rank."""
    node_keys = [keys.node(r, i) for i in range(size)]
    if not node_keys or not store.check(node_keys):
        return [None] * size
    sizes: list[int | None] = []
    for raw in store.multi_get(node_keys):
        try:  # the record's own text, before its MAC (which the controller, without the job's key, cannot check)
            sizes.append(json.loads(raw.split(MARK)[0]).get("local_world_size"))
        except (ValueError, AttributeError):
            sizes.append(None)
    return sizes
