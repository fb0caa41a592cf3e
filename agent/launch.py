"""Compose one agent run from a :class:`~kelastic.agent.launch_config.LaunchConfig`.

:func:`launch_agent` builds the rendezvous handler (kelastic's, or torch's
``c10d``/``static`` unchanged), the worker spec and the local agent, serves the
health endpoints and ``/metrics`` (:mod:`kelastic.agent.telemetry`) when asked,
runs the agent and tears everything down:

* on a normal end (success or failure) the rendezvous is closed for the job
  (peers waiting in it give up instead of waiting for a node that will not come
  back): kelastic's ``set_closed()`` then ``shutdown()``; torch's handlers close
  in ``shutdown()``;
* when the agent is stopped by a signal (a pod being deleted) or the
  rendezvous itself failed (store unreachable, job closed by a peer) the job is
  *not* closed: with kelastic the node leaves gracefully (``shutdown()``), so the
  others re-form at once without waiting to detect a dead heartbeat; torch's
  handlers are left alone (their ``shutdown()`` would close the job).

``--standalone`` (or a single-node run without an endpoint) hosts an embedded
rendezvous store on a loopback port the agent bound itself.

The job's secret (:mod:`kelastic.agent.secret`) authenticates the checkpoint service and
the rendezvous peer link; an agent that would serve them beyond loopback without one (and
without ``--insecure-no-secret``) does not start (``SecretError``). The checkpoint service
listens on ``--local-addr``, or on loopback when it is reached there, else on every
interface; the agents tell each other their services with their role infos, and each
tells its own service the round's ring (:meth:`CheckpointService.set_ring`). With kelastic's
rendezvous every node also announces its service in the store, and every node's service
sends its parts to the announced nodes that are not on the ring: the standbys
(:mod:`kelastic.agent.checkpoint.standbys`).

When the run fails (workers failed with no restarts left, or the agent itself
could not run them) the agent writes one line naming the root cause to its
termination message file, as a Kubernetes-native program does: the file named by
``KELASTIC_TERMINATION_MESSAGE_PATH``, else ``/dev/termination-log``. Kubernetes
shows that line as the container's ``state.terminated.message``, which the
operator quotes in the job's Failed condition. Writing it is best effort.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import kelastic.agent.rendezvous  # noqa: F401  (registers the "kelastic" backend with torch)
from kelastic.agent import contract, secret
from kelastic.agent.api import LossWatcher, NamedNode, RunResult, WorkerSpec
from kelastic.agent.checkpoint.folder import claim_folder
from kelastic.agent.checkpoint.plan import StandbyHolder
from kelastic.agent.checkpoint.service import CheckpointService
from kelastic.agent.checkpoint.settings import (
    CheckpointSettings,
    auto_limit,
    container_memory_limit,
    format_bytes,
    machine_memory,
)
from kelastic.agent.checkpoint.standbys import StandbyBoard, announce_when_reachable
from kelastic.agent.events import default_sink
from kelastic.agent.health import HealthServer
from kelastic.agent.launch_config import LaunchConfig, resolve_job_secret
from kelastic.agent.local_agent import LocalElasticAgent
from kelastic.agent.multiprocessing import SignalException
from kelastic.agent.rendezvous.handler import KelasticRendezvousHandler
from kelastic.agent.rendezvous.server import RendezvousServer
from kelastic.agent.summary import root_cause_line
from kelastic.agent.telemetry import AgentTelemetry

__all__ = ["launch_agent", "node_name", "remove_empty_folders", "write_termination_message"]

_log = logging.getLogger(__name__)


def _leave_rendezvous(handler: RendezvousHandler, *, close_job: bool) -> None:
    # A handler that tells a leaving node from a lost one (kelastic's) leaves with
    # shutdown() and closes the job with set_closed(); torch's close it in shutdown().
    leaves = isinstance(handler, LossWatcher)
    try:
        if close_job and leaves:
            handler.set_closed()
        if close_job or leaves:
            handler.shutdown()
    except Exception as e:  # best effort: the store may already be gone
        _log.warning("leaving the rendezvous failed: %s", e)


def node_name() -> str:
    """This node's name in messages: ``KELASTIC_NODE_NAME`` (the pod name) or the host name."""
    return os.environ.get(contract.ENV_NODE_NAME) or socket.gethostname()


def write_termination_message(message: str) -> bool:
    """Write ``message`` to the termination message file; False (logged at debug) if it cannot.

    The file is ``$KELASTIC_TERMINATION_MESSAGE_PATH``, else ``/dev/termination-log``;
    it is replaced, not appended to (one run, one root cause).
    """
    path = os.environ.get(contract.ENV_TERMINATION_MESSAGE_PATH) or contract.DEFAULT_TERMINATION_MESSAGE_PATH
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(message.rstrip("\n") + "\n")
    except OSError as e:  # outside a container the default path is usually not writable
        _log.debug("could not write the termination message to %s: %s", path, e)
        return False
    return True


def remove_empty_folders(root: Path) -> None:
    """After the node's checkpoint memory ``<dir>/<run id>/<node>`` was freed: remove the run's
    folder, and the default tmpfs folder, if nothing else is left in them (another agent of the
    machine may still use them: a folder that is not empty stays)."""
    from kelastic.agent.checkpoint.settings import DEFAULT_DIR

    folders = [root, root.parent]
    if root.parent.parent == Path(DEFAULT_DIR):
        folders.append(root.parent.parent)
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty (or not ours to remove): it stays, and so do those above
            return


def start_checkpoint_service(
    flags: CheckpointSettings,
    run_id: str,
    node: str,
    advertise: str,
    bind: str,
    key: secret.JobSecret,
    standbys: StandbyBoard | None = None,
) -> CheckpointService:
    """This node's checkpoint service, in ``<checkpoint dir>/<run id>/<node>``, answering
    only clients that prove ``key``; ``flags`` are the settings the command line gave
    every node, placed on this one here (its folder made, an ``auto`` limit derived).
    ``standbys``: the job's standby announcements, whose standbys get copies of its parts."""
    claim = claim_folder(flags.node_folder(run_id, node))
    root = claim.path
    if flags.limit is None:
        try:
            st = os.statvfs(root)
            tmpfs_free: int | None = st.f_bavail * st.f_frsize
        except OSError:
            tmpfs_free = None
        limit, reason = auto_limit(container_memory_limit(), machine_memory(), tmpfs_free)
    else:
        limit, reason = flags.limit, flags.limit_reason
    settings = flags.for_node(root, node, limit, reason)

    def restored(status: dict[str, object]) -> None:
        info = status.get("restored") or {}
        assert isinstance(info, dict)
        _log.info(
            "restored checkpoint %s%s from %s in %.2f s (%s local, %s fetched)",
            info.get("id"),
            f" (step {info['step']})" if info.get("step") is not None else "",
            {"memory": "memory", "replica": "a replica", "durable": "disk"}.get(
                str(info.get("source")), info.get("source")
            ),
            float(info.get("seconds") or 0.0),
            format_bytes(int(info.get("local") or 0)),
            format_bytes(int(info.get("fetched") or 0)),
        )

    return CheckpointService(
        settings,
        key,
        host=bind,
        advertise=advertise,
        on_restore=restored,
        standbys=None if standbys is None else standbys.holders,
        claim=claim,
    ).start()


def _worker_pids(agent: LocalElasticAgent) -> list[int]:
    """The pids of the agent's current workers (none before they started)."""
    return [w.id for w in agent.get_worker_group().workers if isinstance(w.id, int)]


def launch_agent(config: LaunchConfig) -> RunResult:
    """Run this node's agent to completion; see the module docstring for teardown rules.

    Raises :class:`~kelastic.agent.multiprocessing.SignalException` when stopped by a
    signal, rendezvous errors (closed, timed out, unreachable) as they come, and
    :class:`~kelastic.agent.secret.SecretError` when the agent must not serve without a secret.
    """
    key = config.job_secret if config.job_secret is not None else resolve_job_secret(config)
    if key is not None and key.source is secret.SecretSource.INSECURE:
        _log.warning(
            "%s: the checkpoint service and the peer link accept anyone who reaches them; they can "
            "read and replace the job's checkpoints and run code in its workers (docs/security.md)",
            contract.FLAG_INSECURE_NO_SECRET,
        )
    try:
        return _launch(config, key)
    finally:
        if key is not None:
            key.discard()


def _rdzv_secret(config: LaunchConfig, key: secret.JobSecret | None) -> dict[str, object]:
    """What the kelastic rendezvous backend needs for its peer link: the key's file, or the
    explicit opt-out (torch's backends get nothing: they run no peer link)."""
    if config.rdzv_backend != "kelastic" or key is None:
        return {}
    if key.source is secret.SecretSource.INSECURE:
        return {"insecure_no_secret": True}
    return {"job_secret_file": key.path}


def _launch(config: LaunchConfig, key: secret.JobSecret | None) -> RunResult:
    embedded: RendezvousServer | None = None
    endpoint = config.rdzv_endpoint
    if config.standalone:
        embedded = RendezvousServer("127.0.0.1", 0).start()
        endpoint = embedded.endpoint
    health: HealthServer | None = None
    agent: LocalElasticAgent | None = None
    # Every event still reaches the default sink; the telemetry keeps what /metrics shows.
    telemetry = AgentTelemetry(default_sink())

    failed = False  # the agent's run ended in a failure of the job

    def ready() -> bool:
        """``/readyz``: the agent is in the job, from its start (rendezvous handler and agent
        built) until it exits: waiting for peers or as a standby, training, re-forming, or
        finished and waiting to exit. A re-form is the job's normal life, and the kubelet
        makes every failed probe a Warning event, so only a failed run is not ready."""
        return agent is not None and not failed

    if config.health_port is not None:
        # On the pod's own address when known: pods of a single-node cluster share one
        # network namespace, and every agent uses the same health port.
        health = HealthServer(
            config.health_port, ready, host=config.local_addr or "0.0.0.0", metrics=telemetry.render
        ).start()
        _log.info("serving /healthz, /readyz and /metrics on port %d", health.port)
    handler = None
    checkpoints: CheckpointService | None = None
    finished = False  # the agent reached a result (success or failure) of the job
    try:
        params = RendezvousParameters(
            backend=config.rdzv_backend,
            endpoint=endpoint,
            run_id=config.run_id,
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            local_addr=config.local_addr,
            **{**config.rdzv_configs, **_rdzv_secret(config, key)},
        )
        handler = get_rendezvous_handler(params)
        checkpoints = _node_checkpoint_service(config, handler, endpoint, key)
        agent = _local_agent(config, handler, endpoint, telemetry, checkpoints)
        telemetry.start_sampler(agent.rank_progress)
        telemetry.watch_straggler(agent.straggler_verdict, node=getattr(handler, "node_name", ""))
        if checkpoints is not None:
            telemetry.watch_checkpoint(checkpoints.keeper.status)
            # Only the ranks this agent started (and their own processes) save and restore here.
            checkpoints.keeper.local.set(lambda: _worker_pids(agent))
        _log.info(
            "agent for %s: nnodes=%d:%d nproc_per_node=%d endpoint=%s",
            config.entrypoint_name,
            config.min_nodes,
            config.max_nodes,
            config.nproc_per_node,
            endpoint,
        )
        _log.debug("backend=%s run_id=%s logs=%s", config.rdzv_backend, config.run_id, agent.run_log_dir)
        result = agent.run()
        finished = True
        failed = result.is_failed()
        if result.is_failed():
            if result.failures:
                write_termination_message(root_cause_line(result.failures, node_name()))
            else:
                write_termination_message(f"{config.entrypoint_name} failed on node {node_name()}")
        return result
    except SignalException:
        raise  # stopped from outside (the pod is being deleted): not a failure of the job
    except Exception as e:
        failed = True
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        write_termination_message(f"node {node_name()}: {config.entrypoint_name} could not run: {first}")
        raise
    finally:
        if handler is not None:
            _leave_rendezvous(handler, close_job=finished)
        telemetry.stop()
        if checkpoints is not None:
            checkpoints.stop(remove=True)
            remove_empty_folders(checkpoints.settings.root)
        if health is not None and not (finished and not failed):
            health.stop()
        # After a success the health server answers ready until the process ends (a daemon
        # thread, its socket closed by the exit): the kubelet probes a finished worker until
        # its container ended, and a refused connection would be an Unhealthy Warning event.
        if embedded is not None:
            embedded.stop()


def _node_checkpoint_service(
    config: LaunchConfig, handler: RendezvousHandler, endpoint: str, key: secret.JobSecret | None
) -> CheckpointService | None:
    """This node's checkpoint service, started, or None when ``--checkpoint-memory 0``."""
    if config.checkpoint is None:
        return None
    assert key is not None, "a checkpoint service always has a key (resolve_job_secret)"
    node = handler.node_name if isinstance(handler, NamedNode) else node_name()
    advertise = secret.advertised_address(config.local_addr, endpoint)
    board = None
    if isinstance(handler, KelasticRendezvousHandler):
        board = StandbyBoard(endpoint, config.run_id, handler.settings.job_key)
    service = start_checkpoint_service(
        config.checkpoint,
        config.run_id,
        node,
        advertise,
        secret.bind_address(config.local_addr, advertise),
        key,
        board,
    )
    if board is not None and isinstance(handler, KelasticRendezvousHandler):
        # Every node announces: while it waits without a slot (a standby, or a node that found
        # the group full) the group's nodes send it their parts; on the ring it gets none.
        holder = StandbyHolder(service.endpoint, service.keeper.limit)
        standby = handler.settings.standby

        def announced(slot: int) -> None:
            if standby:
                _log.info(
                    "standby: the group's nodes send its checkpoint service %s their parts", holder.endpoint
                )

        announce_when_reachable(board, node, holder, announced)
    return service


def _local_agent(
    config: LaunchConfig,
    handler: RendezvousHandler,
    endpoint: str,
    telemetry: AgentTelemetry,
    checkpoints: CheckpointService | None,
) -> LocalElasticAgent:
    """The agent of this node's workers, as ``config`` describes them (pure composition)."""
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        rdzv_handler=handler,
        entrypoint=config.entrypoint,
        args=config.args,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=config.master_addr,
        master_port=config.master_port,
        local_addr=config.local_addr,
        redirects=config.redirects,
        tee=config.tee,
    )
    return LocalElasticAgent(
        spec,
        start_method=config.start_method,
        log_dir=config.log_dir,
        local_ranks_filter=config.local_ranks_filter,
        rdzv_endpoint=endpoint,
        event_sink=telemetry,
        metrics=telemetry.metrics,
        recovery=telemetry.last_recovery,
        failure=telemetry.last_failure,
        hang_timeout=config.hang_timeout,
        extra_env=checkpoints.worker_env() if checkpoints is not None else None,
        checkpoint_status=checkpoints.keeper.status if checkpoints is not None else None,
        checkpoint_commits=checkpoints.keeper if checkpoints is not None else None,
        checkpoint_ring=checkpoints,
        stragglers=config.stragglers,
        warm_imports=config.warm_imports,
        start_early=config.start_early,
    )
