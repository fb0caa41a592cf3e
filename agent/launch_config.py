"""What one agent run is made of: :class:`LaunchConfig`, resolved from the command line by
:mod:`kelastic.agent.cli` and carried out by :mod:`kelastic.agent.launch`, and the job's key
for it (:func:`resolve_job_secret`).

It sits below both: the command line builds a config and the launch reads one, and neither
imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kelastic.agent import secret
from kelastic.agent.checkpoint.settings import CheckpointSettings
from kelastic.agent.multiprocessing import Std
from kelastic.agent.straggler import StragglerRule

__all__ = ["LaunchConfig", "resolve_job_secret"]


@dataclass
class LaunchConfig:
    """Everything the agent needs, resolved from flags and ``PET_*`` variables."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str
    role: str = "default"
    rdzv_backend: str = "kelastic"
    rdzv_endpoint: str = ""
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_ranks_filter: set[int] | None = None
    local_addr: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    health_port: int | None = None
    #: Restart the workers when none of the local ranks reported progress this long (seconds).
    hang_timeout: float | None = None
    #: The straggler rule (``--stragglers``; kelastic backend): Report by default.
    stragglers: StragglerRule | None = field(default_factory=StragglerRule)
    #: The memory checkpoint service (kelastic.checkpoint) as the flags set it, for every
    #: node (``CheckpointSettings.for_node`` places it on this one); None turns it off.
    checkpoint: CheckpointSettings | None = None
    #: The file holding the job's secret (``--job-secret-file``), and the explicit opt-out
    #: that lets services without one listen beyond loopback (``--insecure-no-secret``).
    job_secret_file: str | None = None
    insecure_no_secret: bool = False
    #: The key itself, once read (or made: :func:`resolve_job_secret`); never printed.
    job_secret: secret.JobSecret | None = field(default=None, repr=False)
    entrypoint: Callable[..., Any] | str = ""
    args: tuple[Any, ...] = ()
    entrypoint_name: str = ""
    #: The script's modules the warm start's fork server imports after torch
    #: (``--warm-imports script``: :func:`kelastic.agent.warmimports.script_imports`).
    warm_imports: tuple[str, ...] = ()
    #: A standby starts its workers while it waits for a place (its script imports
    #: ``kelastic.inprocess``: :func:`kelastic.agent.warmimports.script_uses`).
    start_early: bool = False


def resolve_job_secret(config: LaunchConfig) -> secret.JobSecret | None:
    """The key of this agent's services (:mod:`kelastic.agent.secret`): read from
    ``--job-secret-file``, the public one of ``--insecure-no-secret``, one made for a
    single-node run on loopback, or None when the agent serves no kelastic protocol.
    SecretError (a ValueError naming the flag and the file) when it must not start."""
    return secret.for_agent(
        secret_file=config.job_secret_file,
        insecure=config.insecure_no_secret,
        serves=config.checkpoint is not None or config.rdzv_backend == "kelastic",
        local_addr=config.local_addr,
        rdzv_endpoint=config.rdzv_endpoint,
        standalone=config.standalone,
        max_nodes=config.max_nodes,
    )
