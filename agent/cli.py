"""``kelastic-agent`` (also ``python -m kelastic.agent``): a drop-in for ``torchrun``.

Takes torchrun's flags with torchrun's defaults, except that the rendezvous
backend defaults to ``kelastic``. Every flag also has its underscore spelling
(``--nproc_per_node``) and falls back to the ``PET_<FLAG>`` environment
variable (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ...) when not given on the
command line, the torchrun/Kubeflow convention. ``--health-port`` serves
``/healthz`` and ``/readyz`` for Kubernetes probes.

Exit status: 0 only when this node's workers succeeded. A worker failure
prints a failure summary naming the root cause (rank, host, exit code or
signal, error file and traceback) and exits 1; a rendezvous that cannot be
reached or formed prints what it waited for and exits 1; a signal to the agent
stops the workers with the same signal and exits ``128 + signal``; bad flags
are usage errors (exit 2).

Without ``--rdzv-endpoint``, a single-node run (``--nnodes 1``) and
``--standalone`` host an embedded rendezvous store on loopback.

Beyond torchrun: ``--warm-start`` (or ``PET_WARM_START=1``) forks workers from a
server that has already imported torch instead of starting a fresh interpreter
for every (re)start, which turns a recovery from a lost or added node from
seconds of ``import torch`` into a fork (see :mod:`kelastic.agent.warm` for
what a script may notice); the server also imports the installed packages the script
imports at module level, unless ``--warm-imports torch`` (``PET_WARM_IMPORTS=torch``).
``$KELASTIC_EVENTS_FILE`` receives the agent's structured events as JSON lines.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kelastic.agent import contract, devices, secret, waiting, warm
from kelastic.agent.checkpoint.settings import CheckpointSettings, parse_quantity
from kelastic.agent.events import Event, EventMetadataValue, EventSink, EventSource, default_sink, record
from kelastic.agent.launch_config import LaunchConfig, resolve_job_secret
from kelastic.agent.multiprocessing import Std
from kelastic.agent.process_exit import exit_process
from kelastic.agent.straggler import parse_rule
from kelastic.agent.warmimports import module_source, script_imports, script_uses

__all__ = [
    "LaunchConfig",
    "build_parser",
    "config_from_args",
    "main",
    "parse_nnodes",
    "parse_nproc_per_node",
    "resolve_job_secret",
]

_log = logging.getLogger("kelastic.agent")

_BACKENDS_HINT = "kelastic (default), c10d or static"


def parse_checkpoint_flags(args: argparse.Namespace) -> CheckpointSettings | None:
    """The checkpoint service's settings for every node, or None when ``--checkpoint-memory 0``
    turns it off. ValueError names the bad flag."""
    text = str(args.checkpoint_memory).strip()
    memory = None if text == "auto" else parse_quantity(text)
    if memory == 0:
        return None
    return CheckpointSettings(
        root=Path(args.checkpoint_dir),
        limit=memory,
        node="",
        replicas=args.checkpoint_replicas,
        persist_dir=args.checkpoint_persist_dir or None,
        persist_every=args.checkpoint_persist_every,
        persist_interval=args.checkpoint_persist_interval,
    )


# --- parsing (pure) -----------------------------------------------------------------------------


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"4"`` → (4, 4); ``"2:4"`` → (2, 4). ValueError unless 1 <= min <= max."""
    parts = text.strip().split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--nnodes must be N or MIN:MAX (integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--nnodes needs 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def parse_nproc_per_node(text: str) -> int:
    """An integer >= 1, or ``auto`` (accelerators if any, else CPUs), ``cpu`` or ``gpu``."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {n}")
        return n
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        # Never torch.cuda.is_available(): it initialises CUDA in the agent, and the warm
        # start's workers, forks of the agent, could then not use it (see kelastic.agent.devices).
        gpus = devices.cuda_device_count()
        if gpus > 0:
            return gpus
        if text == "gpu":
            raise ValueError(
                "--nproc-per-node gpu: CUDA is not available on this node; use an integer, cpu or auto"
            )
        return os.cpu_count() or 1
    raise ValueError(f"--nproc-per-node must be an integer, auto, cpu or gpu, got {text!r}")


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` → dict; ValueError naming the bad pair."""
    conf: dict[str, str] = {}
    for pair in (p.strip() for p in text.split(",")):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf expects key=value pairs separated by commas, got {pair!r}")
        conf[key.strip()] = value.strip()
    return conf


def parse_ranks_filter(text: str) -> set[int] | None:
    if not text.strip():
        return None
    try:
        ranks = {int(r) for r in text.split(",") if r.strip()}
    except ValueError:
        raise ValueError(
            f"--local-ranks-filter must be comma-separated integers like 0,1,2, got {text!r}"
        ) from None
    if not ranks or min(ranks) < 0:
        raise ValueError(f"--local-ranks-filter must name local ranks >= 0, got {text!r}")
    return ranks


#: ``--warm-imports``: what the warm start's fork server imports ahead of the workers.
WARM_IMPORTS = ("script", "torch")


def _env_default(dest: str, default: Any) -> Any:
    return os.environ.get(f"{contract.PET_PREFIX}{dest.upper()}", default)


def _env_flag(dest: str) -> bool:
    value = os.environ.get(f"{contract.PET_PREFIX}{dest.upper()}", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


class _AgentParser(argparse.ArgumentParser):
    """argparse holds a flag's value to its ``choices``, never its default; a ``PET_*`` variable is
    a default here, so its value is held to them after parsing (a usage error, exit 2, naming the
    variable), not found wrong after the rendezvous."""

    env_choices: dict[str, tuple[str, tuple[str, ...]]]

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
        namespace, rest = super().parse_known_args(*args, **kwargs)
        for dest, (env, choices) in self.env_choices.items():
            value = getattr(namespace, dest, None)
            if value not in choices:
                self.error(f"{env}={value!r}: invalid choice (choose from {', '.join(map(repr, choices))})")
        return namespace, rest


def build_parser() -> argparse.ArgumentParser:
    """torchrun's flags (dash and underscore spellings, ``PET_*`` fallbacks) plus ``--health-port``."""
    p = _AgentParser(
        prog="kelastic-agent",
        description="Start and supervise this node's workers of an elastic PyTorch job (torchrun-compatible).",
    )

    # A flag is named by its long form, with or without the dashes (the contract's
    # FLAG_* constants carry them).
    def names(name: str, short: str | None) -> tuple[str, list[str]]:
        name = name.removeprefix("--")
        dest = name.replace("-", "_")
        flags = ([short] if short else []) + [f"--{name}"] + ([f"--{dest}"] if dest != name else [])
        return dest, flags

    p.env_choices = {}

    def opt(name: str, *, default: Any, help: str, short: str | None = None, **kw: Any) -> None:
        dest, flags = names(name, short)
        env = f"{contract.PET_PREFIX}{dest.upper()}"
        if "choices" in kw and env in os.environ:
            p.env_choices[dest] = (env, tuple(kw["choices"]))
        p.add_argument(*flags, dest=dest, default=_env_default(dest, default), help=help, **kw)

    def flag(name: str, *, help: str, short: str | None = None) -> None:
        dest, flags = names(name, short)
        p.add_argument(*flags, dest=dest, action="store_true", default=_env_flag(dest), help=help)

    opt(contract.FLAG_NNODES, default="1:1", type=str, help="number of nodes, N or MIN:MAX (default 1:1)")
    opt(
        contract.FLAG_NPROC_PER_NODE,
        default="1",
        type=str,
        help="workers per node: an integer, auto, cpu or gpu (default 1)",
    )
    opt(
        contract.FLAG_RDZV_BACKEND, default="kelastic", type=str, help=f"rendezvous backend: {_BACKENDS_HINT}"
    )
    opt(contract.FLAG_RDZV_ENDPOINT, default="", type=str, help="rendezvous store HOST:PORT")
    opt(contract.FLAG_RDZV_ID, default="none", type=str, help="job id shared by all nodes of a job")
    opt(
        contract.FLAG_RDZV_CONF,
        default="",
        type=str,
        help="extra rendezvous settings, key=value,... (e.g. join_timeout=600)",
    )
    flag("standalone", help="single-node job with an embedded rendezvous store on a free port")
    flag(
        contract.FLAG_STANDBY,
        help="start as a hot standby (kelastic backend): warm, waiting in the rendezvous without a rank, "
        "it never grows the group and takes the place of the first member lost",
    )
    opt(
        contract.FLAG_MAX_RESTARTS,
        default=0,
        type=int,
        help="worker group restarts before failing (default 0)",
    )
    opt("monitor-interval", default=0.1, type=float, help="seconds between worker checks (default 0.1)")
    opt(
        "start-method",
        default="spawn",
        type=str,
        choices=["spawn", "fork", "forkserver"],
        help="how callables are started (default spawn)",
    )
    opt("role", default="default", type=str, help="role of this node's workers")
    flag("module", short=contract.FLAG_MODULE, help="run the script as a Python module (python -m)")
    flag(contract.FLAG_NO_PYTHON, help="run the script as a program, without prepending python")
    flag("run-path", help="run the script with runpy.run_path in the worker instead of a new interpreter")
    flag(
        contract.FLAG_WARM_START,
        help="fork workers from a server that already imported torch (much faster restarts; see kelastic.agent.warm)",
    )
    opt(
        contract.FLAG_WARM_IMPORTS,
        default="script",
        type=str,
        choices=list(WARM_IMPORTS),
        help="with --warm-start, what the fork server imports ahead of the workers: script (default: torch "
        "and the installed packages the script imports at module level) or torch (torch only, for packages "
        "that read RANK or initialise CUDA when imported)",
    )
    opt(
        "log-dir",
        default=None,
        type=str,
        help="base directory of worker logs (default: a temporary directory)",
    )
    opt(
        "redirects",
        short="-r",
        default="0",
        type=str,
        help="redirect std streams to files: 0-3 or rank:0-3,...",
    )
    opt(
        "tee",
        short="-t",
        default="0",
        type=str,
        help="tee std streams to files and console: 0-3 or rank:0-3,...",
    )
    opt(
        "local-ranks-filter",
        default="",
        type=str,
        help="show console output of these local ranks only (e.g. 0,1)",
    )
    opt("node-rank", default=0, type=int, help="this node's rank (static backend only)")
    opt("master-addr", default="127.0.0.1", type=str, help="master address (static backend only)")
    opt("master-port", default=29500, type=int, help="master port (static backend only)")
    opt(
        contract.FLAG_LOCAL_ADDR,
        default=None,
        type=str,
        help="address peers reach this node on (default: this host's name)",
    )
    opt(
        contract.FLAG_HEALTH_PORT,
        default=None,
        type=int,
        help="serve /healthz, /readyz and /metrics on this port",
    )
    opt(
        contract.FLAG_HANG_TIMEOUT,
        default=None,
        type=float,
        help="restart the workers (spending a restart) when none of the local ranks that reported "
        "progress (kelastic.agent.progress.update) did so for this many seconds",
    )
    opt(
        contract.FLAG_STRAGGLERS,
        default="",
        type=str,
        help="the straggler rule (kelastic backend): policy=Report|Replace,ratio=R,window=SECONDS; a member "
        "whose own work per step stays R times the others' median for the window is reported, and with "
        "Replace swapped for a standby at the next checkpoint (default policy=Report,ratio=1.5,window=10)",
    )
    opt(
        contract.FLAG_CHECKPOINT_MEMORY,
        default="auto",
        type=str,
        help="bytes this node may hold of memory checkpoints (kelastic.checkpoint), a quantity "
        "like 4Gi; auto (default): 40%% of the container's memory limit; 0 turns them off",
    )
    opt(
        contract.FLAG_CHECKPOINT_REPLICAS,
        default=1,
        type=int,
        help="copies of this node's checkpoint part kept on the next nodes of the ring (default 1)",
    )
    opt(
        contract.FLAG_CHECKPOINT_DIR,
        default="/dev/shm/kelastic-checkpoints",
        type=str,
        help="tmpfs folder for the memory checkpoints (default /dev/shm/kelastic-checkpoints)",
    )
    opt(
        contract.FLAG_CHECKPOINT_PERSIST_DIR,
        default="",
        type=str,
        help="durable directory for copies of the memory checkpoints, in DCP's layout (default: none)",
    )
    opt(
        contract.FLAG_CHECKPOINT_PERSIST_EVERY,
        default=0,
        type=int,
        help="write every Nth checkpoint to the durable directory",
    )
    opt(
        contract.FLAG_CHECKPOINT_PERSIST_INTERVAL,
        default=0.0,
        type=float,
        help="write a checkpoint to the durable directory when this many seconds passed since the last",
    )
    p.add_argument(
        contract.FLAG_JOB_SECRET_FILE,
        dest="job_secret_file",
        default=os.environ.get(contract.ENV_JOB_SECRET_FILE) or _env_default("job_secret_file", None),
        type=str,
        help="file holding the job's secret, which authenticates the agents' services to each other "
        f"and to the workers (default ${contract.ENV_JOB_SECRET_FILE}; docs/security.md)",
    )
    p.add_argument(
        contract.FLAG_INSECURE_NO_SECRET,
        dest="insecure_no_secret",
        action="store_true",
        default=_env_flag("insecure_no_secret")
        or os.environ.get(contract.ENV_INSECURE_NO_SECRET, "").strip().lower() in ("1", "true", "yes", "on"),
        help="serve beyond loopback without a job secret: anyone who reaches the ports can read and "
        "replace the job's checkpoints (docs/security.md)",
    )
    p.add_argument("training_script", type=str, help="the script (or module, or program) each worker runs")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Resolve parsed flags into a :class:`LaunchConfig`; ValueError names the bad flag."""
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    nproc = parse_nproc_per_node(args.nproc_per_node)
    _check_flags(args)
    checkpoint = parse_checkpoint_flags(args)
    rdzv_conf: dict[str, Any] = parse_rdzv_conf(args.rdzv_conf)
    backend = args.rdzv_backend.strip()
    endpoint = args.rdzv_endpoint.strip()
    run_id = args.rdzv_id
    standalone = bool(args.standalone)
    if standalone:
        if backend not in ("kelastic", "c10d"):
            raise ValueError(
                f"--standalone uses the kelastic backend; it conflicts with --rdzv-backend {backend}"
            )
        backend, endpoint = "kelastic", ""
        run_id = str(uuid.uuid4())
    master_addr = master_port = None
    if backend == "static":
        rdzv_conf["rank"] = args.node_rank
        if not endpoint:
            endpoint = f"{args.master_addr}:{args.master_port}"
        master_addr, master_port = None, None  # static's rendezvous hands them out
    elif backend == "kelastic" and not endpoint:
        if max_nodes > 1 and not standalone:
            raise ValueError(
                f"--rdzv-endpoint HOST:PORT is required with --rdzv-backend kelastic and --nnodes {args.nnodes}; "
                "point it at a kelastic-rendezvous store, or use --standalone for a single node"
            )
        standalone = True
    elif not endpoint:
        raise ValueError(f"--rdzv-endpoint HOST:PORT is required with --rdzv-backend {backend}")
    if endpoint and not standalone:
        host, sep, port = endpoint.rpartition(":")
        if backend != "c10d" and (not sep or not host or not port.isdigit()):
            raise ValueError(f"--rdzv-endpoint must be HOST:PORT, got {endpoint!r}")

    if args.standby:
        if backend != "kelastic" or standalone:
            raise ValueError(
                "--standby waits in a kelastic rendezvous shared with the job's other nodes: it needs "
                f"--rdzv-backend kelastic and --rdzv-endpoint (got --rdzv-backend {args.rdzv_backend}"
                f"{', --standalone' if standalone else ''})"
            )
        rdzv_conf["standby"] = "1"

    script = args.training_script
    entrypoint, cmd_args, start_method = _entrypoint(args)
    warm_imports: list[str] = []
    if args.warm_start and args.warm_imports == "script":
        warm_imports = script_imports(script, module=bool(args.module), exclude=warm.PRELOAD)

    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        role=args.role,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_conf,
        standalone=standalone,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        start_method=start_method,
        log_dir=args.log_dir,
        redirects=Std.from_str(args.redirects),
        tee=Std.from_str(args.tee),
        local_ranks_filter=parse_ranks_filter(args.local_ranks_filter),
        local_addr=args.local_addr,
        master_addr=master_addr,
        master_port=master_port,
        health_port=args.health_port,
        hang_timeout=args.hang_timeout,
        stragglers=parse_rule(args.stragglers),
        checkpoint=checkpoint,
        job_secret_file=args.job_secret_file or None,
        insecure_no_secret=bool(args.insecure_no_secret),
        entrypoint=entrypoint,
        args=tuple(cmd_args),
        entrypoint_name=os.path.basename(script),
        warm_imports=tuple(warm_imports),
        # The workers run the script up to kelastic.inprocess.run while the first rendezvous waits.
        start_early=_uses_inprocess(script, bool(args.module)),
    )


def _uses_inprocess(script: str, module: bool) -> bool:
    """Whether the training script (a path, or with ``module`` a module name) imports
    ``kelastic.inprocess``: its workers can wait parked for their first group."""
    path = script
    if module:
        try:
            path = module_source(script, os.getcwd()) or ""
        except (ImportError, ValueError, OSError):
            return False
    return bool(path) and script_uses(path, "kelastic.inprocess")


def _check_flags(args: argparse.Namespace) -> None:
    """The checks of single flags and of flags that exclude each other; ValueError names them."""
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.monitor_interval > 0:
        raise ValueError(f"--monitor-interval must be > 0, got {args.monitor_interval}")
    if args.module and args.no_python:
        raise ValueError("-m/--module and --no-python are mutually exclusive")
    if args.run_path and (args.module or args.no_python):
        raise ValueError("--run-path cannot be combined with -m/--module or --no-python")
    if args.no_python and shutil.which(args.training_script) is None:
        raise ValueError(f"--no-python: program {args.training_script!r} was not found or is not executable")
    if args.warm_imports not in WARM_IMPORTS:  # PET_WARM_IMPORTS escapes argparse's choices
        raise ValueError(
            f"--warm-imports must be one of {', '.join(WARM_IMPORTS)}, got {args.warm_imports!r}"
        )
    if args.warm_start and args.no_python:
        raise ValueError(
            "--warm-start runs Python scripts and modules; it cannot be combined with --no-python"
        )
    if args.health_port is not None and not 0 <= args.health_port < 65536:
        raise ValueError(f"--health-port must be in 0..65535, got {args.health_port}")
    if args.hang_timeout is not None and args.hang_timeout <= 0:
        raise ValueError(f"--hang-timeout must be > 0 seconds, got {args.hang_timeout}")
    parse_rule(args.stragglers)  # ValueError names the setting


def _entrypoint(args: argparse.Namespace) -> tuple[Callable[..., Any] | str, list[str], str]:
    """What every worker runs (a binary or a function of the warm start), its arguments and
    the start method it needs (pure)."""
    script = args.training_script
    script_args = list(args.training_script_args)
    entrypoint: Callable[..., Any] | str
    start_method = args.start_method
    if args.warm_start:
        entrypoint = warm.run_module if args.module else warm.run_script
        cmd_args, start_method = [script, *script_args], "forkserver"
    elif args.no_python:
        entrypoint, cmd_args = script, script_args
    elif args.module:
        entrypoint, cmd_args = sys.executable, ["-u", "-m", script, *script_args]
    elif args.run_path:
        entrypoint, cmd_args = warm.run_script, [script, *script_args]
    else:
        entrypoint, cmd_args = sys.executable, ["-u", script, *script_args]
    return entrypoint, cmd_args, start_method


# --- running --------------------------------------------------------------------------------------


def process_started_at() -> float | None:
    """When this process was created (epoch seconds, to the kernel's clock tick), or None
    where ``/proc`` does not tell (not Linux). Counts the interpreter's start-up and every
    import before the agent's first line, which a timestamp taken in Python would miss."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # Field 22 (starttime, ticks after boot); the command name in (...) may hold spaces.
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(0.0, age)


def _startup_event(sink: EventSink, name: str, **metadata: EventMetadataValue) -> None:
    """An agent event before the agent exists (same metadata keys as the agent's own)."""
    node = os.environ.get(contract.ENV_NODE_NAME) or socket.gethostname()
    record(
        Event(name=name, source=EventSource.AGENT, metadata={"node": node, "pid": os.getpid(), **metadata}),
        sink,
    )


def run(config: LaunchConfig) -> int:
    """Run the agent for ``config``; return the process exit status."""
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        # as torchrun does: several ranks per node must not each use every core
        os.environ["OMP_NUM_THREADS"] = "1"
    sink = default_sink()
    _startup_event(sink, "kelastic.agent.started", process_start=process_started_at())
    began = time.monotonic()
    forked = False
    try:
        with warm.paused_gc():  # imports only: collections would scan torch's objects for nothing
            if config.start_method == "forkserver":
                # The agent needs torch anyway: import it once, then fork the fork server from
                # here, while this process still runs a single thread (see kelastic.agent.warm).
                forked = warm.fork_forkserver(script_modules=config.warm_imports)
            from torch.distributed.elastic.rendezvous import RendezvousError

            from kelastic.agent.launch import launch_agent
            from kelastic.agent.multiprocessing import SignalException, install_signal_handlers
            from kelastic.agent.summary import format_failure_summary
    except ImportError as e:  # torch is there (the launcher checked) but does not import
        print(
            f"kelastic-agent: {sys.executable} cannot import torch.distributed: {e}. "
            "Install a PyTorch build with distributed support in this image.",
            file=sys.stderr,
            flush=True,
        )
        return 1

    _startup_event(
        sink, "kelastic.agent.torch_imported", seconds=round(time.monotonic() - began, 3), warm_forked=forked
    )
    # From here on SIGTERM & co. raise SignalException, so workers are stopped with the same signal.
    install_signal_handlers()
    try:
        result = launch_agent(config)
    except SignalException as e:
        what = waiting.ended_by(e)
        _log.warning(
            "stopped by %s%s", signal.Signals(e.sigval).name, f" while waiting for {what}" if what else ""
        )
        return 128 + int(e.sigval)
    except (RendezvousError, TimeoutError, ConnectionError, OSError, RuntimeError, ValueError) as e:
        print(f"kelastic-agent: {config.entrypoint_name} could not run: {e}", file=sys.stderr, flush=True)
        return 1
    if result.is_failed():
        if result.failures:
            print(
                format_failure_summary(config.entrypoint_name, result.failures, socket.gethostname()),
                file=sys.stderr,
                flush=True,
            )
        else:
            print(f"kelastic-agent: {config.entrypoint_name} FAILED", file=sys.stderr, flush=True)
        return 1
    return 0


def log_format(level: str) -> str:
    """The agent's log line format for ``LOGLEVEL`` ``level``: torchrun's short prefix
    (``[I 18:58:29] message``, the level's first letter and the time), so an INFO line fits
    one line of a terminal; at DEBUG the logger's name follows the time (who said it)."""
    if level == "DEBUG":
        return "[%(levelname).1s %(asctime)s %(name)s] %(message)s"
    return "[%(levelname).1s %(asctime)s] %(message)s"


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console-script entry point; exits with the status documented in the module docstring.

    The process ends with ``os._exit`` once the clean-up ran (:func:`exit_process`): call
    it as a program, not from a process that should go on."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        # Before anything else starts: a missing or unusable secret is a usage error, told
        # in one line (a pod's log tail, which the operator quotes, holds no usage text).
        config.job_secret = resolve_job_secret(config)
    except secret.SecretError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ValueError as e:
        parser.error(str(e))
    level = os.environ.get("LOGLEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=log_format(level), datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        status = run(config)
    finally:
        if config.job_secret is not None:
            config.job_secret.discard()  # an ephemeral key's folder, whatever happened
    # Not sys.exit: a daemon thread still blocked in a torch call (a store read on a
    # connection a partition left stale) would abort a finishing interpreter (process_exit).
    exit_process(status)
