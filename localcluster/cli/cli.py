"""``kelastic local up`` and ``kelastic local run``: a Kubernetes on this machine.

``kelastic local up [--kubeconfig PATH] [--port N] [--state-dir DIR]`` runs the
local cluster in the foreground: API server, process kubelet, endpoints
controller and service proxy; it applies the CRDs of ``crds/``, starts the
kelastic operator (``python -m kelastic.operator``) when it is installed,
writes the kubeconfig and prints how to point kubectl at it. SIGTERM or Ctrl-C
stops everything, pod processes included.

Both take ``--control-plane DIR`` (else ``$KELASTIC_CONTROL_PLANE``, else
``$KUBEBUILDER_ASSETS``): a directory with the real ``kube-apiserver`` and
``etcd`` (and ``kube-controller-manager``, ``kube-scheduler``), run instead of
kelastic's API server emulator (see :mod:`kelastic.localcluster.controlplane.controlplane`).
The operator serves every namespace, as fits a cluster of one user;
``--watch-namespace NS`` (repeatable) narrows it to those. It serves its Prometheus
metrics on the loopback address (``up`` prints the URL).

``kelastic local run MANIFEST.yaml`` brings up a private cluster in a temporary
directory, applies the manifest, relays the pods' logs prefixed by pod, waits
until every workload in it has finished (or one has failed) (pods: phase Succeeded/Failed; other
kinds: see :mod:`kelastic.localcluster.cli.completion`), prints a summary, and
exits 0 only when all of them succeeded (1 when one failed or the wait timed
out, 2 for bad input, 130 or 143 when stopped by SIGINT or SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib.util
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

from ..common.interrupts import interrupt, uninterrupted
from ..common.processes import stop_process
from ..controlplane.controlplane import HOST, control_plane_dir, die_with_parent, free_port
from ..kubelet.images import ImageMap
from .apply import Applier, ManifestError, load_manifests
from .cluster import LocalCluster
from .completion import Outcome, outcome_of, pod_outcome, waitable
from .jobsummary import JobTimeline
from .logrelay import LogFollower, LogRelay

__all__ = ["find_crds_dir", "log_in_kelastic_voice", "main", "operator_command"]

T = TypeVar("T")

#: Kinds applied before everything else: what other objects need to exist first.
_FIRST = ("Namespace", "CustomResourceDefinition")


def find_crds_dir() -> Path | None:
    """The ``crds/`` directory: ``$KELASTIC_CRDS_DIR``, next to the package (source checkout), or ./crds."""
    candidates = []
    if os.environ.get("KELASTIC_CRDS_DIR"):
        candidates.append(Path(os.environ["KELASTIC_CRDS_DIR"]))
    candidates += [Path(__file__).resolve().parents[2] / "crds", Path.cwd() / "crds"]
    for candidate in candidates:
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    return None


def find_chart_dir() -> Path | None:
    """The operator's Helm chart: ``$KELASTIC_CHART_DIR``, next to the package (source checkout), or ./helm/kelastic."""
    candidates = []
    if os.environ.get("KELASTIC_CHART_DIR"):
        candidates.append(Path(os.environ["KELASTIC_CHART_DIR"]))
    candidates += [
        Path(__file__).resolve().parents[2] / "helm" / "kelastic",
        Path.cwd() / "helm" / "kelastic",
    ]
    for candidate in candidates:
        if (candidate / "Chart.yaml").is_file():
            return candidate
    return None


#: A command line that replaces the operator ``kelastic local`` starts (e.g. with other flags).
OPERATOR_OVERRIDE_ENV = "KELASTIC_LOCAL_OPERATOR"


def operator_override() -> list[str] | None:
    """The operator command ``$KELASTIC_LOCAL_OPERATOR`` sets, split like a shell would (None: unset)."""
    raw = os.environ.get(OPERATOR_OVERRIDE_ENV)
    return shlex.split(raw) if raw else None


def operator_command() -> list[str] | None:
    """How to start the kelastic operator, or None when it is not installed.

    ``$KELASTIC_LOCAL_OPERATOR`` (a command line) overrides the default, e.g. to
    pass the operator flags. Otherwise looks for the module's files without
    importing it: the local cluster must not depend on the operator.
    """
    override = operator_override()
    if override is not None:
        return override
    try:
        spec = importlib.util.find_spec("kelastic.operator")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for location in spec.submodule_search_locations or []:
            if (Path(location) / "__main__.py").is_file():
                return [sys.executable, "-m", "kelastic.operator"]
    exe = shutil.which("kelastic-operator")
    return [exe] if exe else None


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived while starting up (a BaseException, like KeyboardInterrupt:
    no ``except Exception`` on the way may swallow it, every ``finally`` stops what it started)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def exit_code(signum: int) -> int:
    """What a shell reports for a command stopped by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


class _Stopper:
    """Turns SIGTERM/SIGINT into an event the foreground loop polls.

    Inside :meth:`interruptible` (the start-up: control plane, chart, manifest) the first
    signal also raises :class:`Interrupted` in the main thread, so that a start-up that
    takes a while stops at once instead of finishing first; later signals only set the
    event, so that they cannot break off the clean-up.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: int | None = None
        self._raise = False

    def _handler(self, signum: int, frame: Any) -> None:
        self.signal = signum
        self.event.set()
        if self._raise:
            self._raise = False
            interrupt(Interrupted(signum))  # at once, or once a child just started is recorded

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Raise :class:`Interrupted` inside this block at the first signal (at once if one came)."""
        if self.signal is not None:
            raise Interrupted(self.signal)
        self._raise = True
        try:
            yield
        finally:
            self._raise = False
        if self.signal is not None:
            # The signal came, but its exception was swallowed on the way (a handler runs
            # wherever the main thread is, a __del__ included): stop now, if not at once.
            raise Interrupted(self.signal)

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Stopper]:
        previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class _Operator:
    """The operator subprocess (own process group, output to a log file).

    ``metrics_url``: where it serves its Prometheus metrics, when kelastic chose the port.
    """

    def __init__(
        self, command: list[str], kubeconfig: Path, log_path: Path, metrics_url: str | None = None
    ) -> None:
        self.log_path = log_path
        self.metrics_url = metrics_url
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        with uninterrupted(), open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # Dies with kelastic even when kelastic is killed without cleaning up.
                preexec_fn=die_with_parent,
            )

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM to its group) without waiting."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, grace: float = 10.0, progress: Callable[[str], None] | None = None) -> None:
        """SIGTERM to its group, wait up to ``grace`` s, then SIGKILL its whole group (what is
        left of it also when the operator itself exited in time)."""
        stop_process(
            self.proc, grace, name="the operator", progress=progress, group=True, kill_leftovers=True
        )


def _apply_all(cluster: LocalCluster, objects: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    assert cluster.client is not None
    applier = Applier(cluster.client)
    ordered = sorted(objects, key=lambda o: 0 if o.get("kind") in _FIRST else 1)

    async def run() -> list[dict[str, Any]]:
        return [await applier.apply(obj) for obj in ordered]

    return cluster.call(run(), timeout=60.0, what="applying the manifest's objects")


def _apply_crds(cluster: LocalCluster, out: TextIO) -> int:
    crds_dir = find_crds_dir()
    if crds_dir is None:
        return 0
    crds = load_manifests(sorted(crds_dir.glob("*.yaml")))
    _apply_all(cluster, crds)
    print(f"kelastic: applied {len(crds)} CRD(s) from {crds_dir}", file=out, flush=True)
    return len(crds)


def _in_thread(what: str, fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread while this one waits, so that a signal can interrupt the wait.

    Helm runs in a native library: a signal handler would run only once its call
    returned. On :class:`Interrupted` the worker is abandoned (a daemon thread); it
    fails soon after, once the cluster it talks to is stopped.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the waiting thread
            error.append(exc)

    worker = threading.Thread(target=work, name=what, daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
    if error:
        raise error[0]
    return result[0]


def _install_chart(
    cluster: LocalCluster, out: TextIO, watch: Sequence[str], cluster_wide: bool, kueue: bool = False
) -> bool:
    """On a real control plane, install the operator from its chart; False when that is not possible here.

    The operator then runs as the chart's Deployment under its ServiceAccount and
    RBAC, in ``watch`` namespaces (or every namespace with ``cluster_wide``).
    """
    chart_dir = find_chart_dir()
    try:
        from .chart import install_chart
    except ImportError as exc:  # helm-python-sdk is an extra
        print(f"kelastic: cannot install the chart ({exc}); starting the operator as a process", file=out)
        return False
    if chart_dir is None:
        print("kelastic: the chart helm/kelastic is not found; starting the operator as a process", file=out)
        return False
    _in_thread(
        "installing the chart",
        lambda: install_chart(
            cluster.kubeconfig,
            chart_dir,
            values={"kueue": {"enabled": True}} if kueue else None,
            watch_namespaces=tuple(watch),
            cluster_wide=cluster_wide,
            progress=_progress(out),
        ),
    )
    return True


def served_namespaces(watch: Sequence[str] | None, cluster_wide: bool) -> tuple[tuple[str, ...], bool]:
    """The namespaces the local operator serves: (namespaces, every namespace).

    A local cluster has one user, so its operator serves every namespace unless
    ``--watch-namespace`` names some (``--cluster-wide`` says the default out loud and
    cannot be combined with them).
    """
    if watch and cluster_wide:
        raise SystemExit("kelastic: --watch-namespace and --cluster-wide exclude each other")
    return (tuple(dict.fromkeys(watch)), False) if watch else ((), True)


def _operator_flags(watch: Sequence[str], cluster_wide: bool, metrics_port: int) -> list[str]:
    """The flags kelastic adds to the operator it starts as a process: its namespaces, and
    metrics on ``metrics_port`` of the loopback address, as the chart serves them on the pod's."""
    scope = ["--all-namespaces"] if cluster_wide else [f"--namespace={ns}" for ns in watch]
    return [*scope, f"--metrics-port={metrics_port}", f"--metrics-address={HOST}"]


def _start_operator(
    cluster: LocalCluster,
    out: TextIO,
    watch: Sequence[str] = (),
    cluster_wide: bool = True,
    log_kept: bool = True,
    kueue: bool = False,
) -> _Operator | None:
    """Start the operator: from the chart on a real control plane, else as a subprocess (None: not installed).

    It serves ``watch`` namespaces, or every namespace with ``cluster_wide``. Its log's path
    is printed only when the log outlives the command (``log_kept``).
    ``$KELASTIC_LOCAL_OPERATOR`` wins on both: whoever sets it asked for that command.
    """
    override = operator_override()
    if cluster.real:
        if override is not None:
            print(
                f"kelastic: ${OPERATOR_OVERRIDE_ENV} is set: running it instead of installing the chart",
                file=out,
            )
        elif _install_chart(cluster, out, watch, cluster_wide, kueue):
            return None
    command = override if override is not None else operator_command()
    if command is None:
        return None
    metrics_url = None
    if override is None:
        # The operator watches only "default" without a scope flag.
        port = free_port()
        command = [*command, *_operator_flags(watch, cluster_wide, port), *(["--kueue"] if kueue else [])]
        metrics_url = f"http://{HOST}:{port}/metrics"
    operator = _Operator(command, cluster.kubeconfig, cluster.data_dir / "operator.log", metrics_url)
    scope = "every namespace" if cluster_wide else f"namespace(s) {', '.join(watch)}"
    log = f"log {operator.log_path}" if log_kept else "its log is kept with --keep"
    print(
        f"kelastic: started the operator for {scope} (pid {operator.proc.pid}, {log})", file=out, flush=True
    )
    return operator


def _progress(out: TextIO) -> Callable[[str], None]:
    def say(line: str) -> None:
        print(f"kelastic: {line}", file=out, flush=True)

    return say


def _image_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="NAME=PYTHON",
        help="run containers of image NAME with the interpreter PYTHON (e.g. a venv with torch only); "
        "repeatable; other images run with this Python environment",
    )


def _images(args: argparse.Namespace) -> ImageMap:
    try:
        return ImageMap.from_options(args.image)
    except ValueError as exc:
        raise SystemExit(f"kelastic: {exc}") from None


def _cpu_quantity(text: str) -> str:
    """A positive cpu quantity as a Node reports it: ``2``, ``0.5``, ``1500m``."""
    if not re.fullmatch(r"(?:\d+(?:\.\d+)?|\d+m)", text) or not re.search(r"[1-9]", text):
        raise argparse.ArgumentTypeError(f"not a positive cpu quantity: {text!r} (e.g. 2, 0.5 or 1500m)")
    return text


def _node_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="the node's nvidia.com/gpu count, handed to pods that request them (default: "
        "$KELASTIC_LOCAL_GPUS, else the GPUs the NVIDIA driver lists; 0: none)",
    )
    parser.add_argument(
        "--cpus",
        type=_cpu_quantity,
        metavar="QUANTITY",
        help="the node's cpu capacity as the scheduler sees it, e.g. 2 or 1500m (default: the machine's "
        "cores); pods are not limited to it, only placed by it",
    )


def _control_plane_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--control-plane",
        type=Path,
        metavar="DIR",
        help="run the real kube-apiserver, etcd, kube-controller-manager and kube-scheduler found in DIR "
        "instead of the API server emulator (default: $KELASTIC_CONTROL_PLANE, else $KUBEBUILDER_ASSETS); "
        "the operator is then installed from its Helm chart",
    )
    parser.add_argument(
        "--cluster-wide",
        action="store_true",
        help="the operator serves every namespace (the default; on --control-plane the chart is "
        "installed with clusterWide=true)",
    )
    parser.add_argument(
        "--watch-namespace",
        action="append",
        metavar="NS",
        help="serve only this namespace (repeatable; default: every namespace); on --control-plane "
        "the chart's watchNamespaces",
    )


def _stop_all(cluster: LocalCluster, operator: _Operator | None) -> None:
    """Stop the operator and the cluster side by side; the operator even when the cluster fails to stop."""
    if operator is not None:
        operator.terminate()
    try:
        cluster.stop()
    finally:  # a cluster that did not stop cleanly must not orphan the operator
        if operator is not None:
            operator.stop(progress=cluster.progress)


# -- up -------------------------------------------------------------------------------
def _up_real_nodes(args: argparse.Namespace) -> int:
    """``--real-nodes N``: the real control plane beside N real nodes (docs/real-nodes.md)."""
    from ..node.up import main as real_nodes

    directory = control_plane_dir(args.control_plane)
    if directory is None:
        print(
            "kelastic: --real-nodes needs --control-plane DIR (make control-plane prints it)", file=sys.stderr
        )
        return 2
    argv = [f"--control-plane={directory}", f"--nodes={args.real_nodes}"]
    argv += [f"--node-dir={args.node_dir}"] if args.node_dir else []
    argv += [f"--state-dir={args.state_dir}"] if args.state_dir else []
    return real_nodes(argv)


def cmd_up(args: argparse.Namespace) -> int:
    if args.real_nodes:
        return _up_real_nodes(args)
    out = sys.stdout
    state_dir = Path(args.state_dir).resolve() if args.state_dir else None
    temp_dir: str | None = None
    if args.data_dir:
        data_dir = Path(args.data_dir)
    elif state_dir is not None:
        data_dir = state_dir / "data"
    else:
        temp_dir = tempfile.mkdtemp(prefix="kelastic-local-")
        data_dir = Path(temp_dir)
    cluster = LocalCluster(
        data_dir,
        port=args.port,
        state_dir=state_dir,
        kubeconfig=args.kubeconfig,
        control_plane=control_plane_dir(args.control_plane),
        progress=_progress(out),
        images=_images(args),
        gpus=args.gpus,
        cpus=args.cpus,
    )
    served = served_namespaces(args.watch_namespace, args.cluster_wide)
    operator: _Operator | None = None
    kueue: Any = None
    if args.kueue and not cluster.real:
        print(
            "kelastic: --kueue needs a real control plane (--control-plane DIR, built by make control-plane): "
            "Kueue's manager runs against kube-apiserver",
            file=sys.stderr,
        )
        return 2
    stopper = _Stopper()
    with stopper.installed():  # also during the clean-up: a second Ctrl-C must not break it off
        try:
            try:
                with stopper.interruptible():
                    cluster.start()
                    _apply_crds(cluster, out)
                    if args.kueue:
                        kueue = _start_kueue(cluster, out, args.kueue)
                    if not args.no_operator:
                        operator = _start_operator(cluster, out, *served, kueue=kueue is not None)
            except Interrupted as exc:
                print(f"kelastic: {exc} while starting: stopping what was started", file=out, flush=True)
                return exit_code(exc.signum)
            metrics = operator.metrics_url if operator is not None else None
            print(
                f"kelastic local is up: API server {cluster.url}\n"
                f"kubeconfig: {cluster.kubeconfig}\n"
                f"  export KUBECONFIG={cluster.kubeconfig}\n"
                "  kubectl get pods -A\n"
                + (f"operator metrics: {metrics}\n" if metrics else "")
                + f"pod logs and volumes: {cluster.data_dir}\n"
                "Stop with Ctrl-C or SIGTERM (pods are stopped with it).",
                file=out,
                flush=True,
            )
            reported = False
            while not stopper.event.wait(1.0):
                if operator is not None and not reported and operator.poll() is not None:
                    print(
                        f"kelastic: the operator exited with code {operator.poll()}; see {operator.log_path}",
                        file=out,
                        flush=True,
                    )
                    reported = True
            print("kelastic: stopping", file=out, flush=True)
        finally:
            try:
                if kueue is not None:
                    kueue.stop()
                _stop_all(cluster, operator)
            finally:
                if temp_dir is not None:
                    shutil.rmtree(temp_dir, ignore_errors=True)
                print("kelastic: stopped", file=out, flush=True)
    return 0


def _start_kueue(cluster: LocalCluster, out: TextIO, flag: str) -> Any:
    """Kueue's manager beside the control plane (docs/kueue.md), from ``flag`` or the build ``make kueue`` made."""
    from ..kueue import KueueBinaries, KueueManager, find_kueue_dir

    directory = find_kueue_dir(None if flag == "auto" else flag)
    if directory is None:
        raise SystemExit(
            "kelastic: --kueue: no Kueue build found; run `make kueue` (it builds sigs.k8s.io/kueue from the Go "
            "module proxy into ~/.cache/kelastic/kueue/<version>), or pass --kueue DIR"
        )
    assert cluster.control_plane is not None
    manager = KueueManager(
        KueueBinaries.find(directory),
        cluster.control_plane,
        (cluster.state_dir or cluster.data_dir) / "kueue",
        progress=_progress(out),
    )
    return manager.start()


# -- run ------------------------------------------------------------------------------
def _describe(obj: dict[str, Any]) -> str:
    return f"{str(obj.get('kind', '')).lower()}/{obj['metadata']['name']}"


def _poll_outcomes(
    cluster: LocalCluster, applier: Applier, objects: Sequence[dict[str, Any]]
) -> list[tuple[Outcome, str]]:
    async def run() -> list[tuple[Outcome, str]]:
        results = []
        for obj in objects:
            current = await applier.get(obj)
            if current is None:
                results.append((Outcome.FAILED, "deleted before it finished"))
            else:
                current.setdefault("apiVersion", obj.get("apiVersion"))
                current.setdefault("kind", obj.get("kind"))
                results.append(outcome_of(current))
        return results

    return cluster.call(run(), timeout=30.0, what="reading the workloads' state")


def _sample_jobs(
    cluster: LocalCluster, applier: Applier, jobs: Sequence[dict[str, Any]], timeline: JobTimeline
) -> None:
    """One look at each ElasticJob's status, for the per-job summary."""

    async def run() -> list[dict[str, Any] | None]:
        return [await applier.get(o) for o in jobs]

    now = time.monotonic()
    for current in cluster.call(run(), timeout=30.0, what="reading the jobs' status"):
        if current is not None:
            timeline.observe(current, now)


def _job_events(cluster: LocalCluster, jobs: Sequence[dict[str, Any]], timeline: JobTimeline) -> None:
    """The Events about each ElasticJob (their reasons explain restarts), for the summary."""
    assert cluster.client is not None
    for ns in {str(o["metadata"].get("namespace") or "default") for o in jobs}:
        listing = cluster.call(
            cluster.client.get(f"/api/v1/namespaces/{ns}/events"),
            timeout=30.0,
            what=f"listing the events in {ns}",
        )
        for job in jobs:
            name = job["metadata"]["name"]
            timeline.set_events(
                name,
                [
                    e
                    for e in listing.get("items") or []
                    if (e.get("involvedObject") or {}).get("kind") == "ElasticJob"
                    and (e.get("involvedObject") or {}).get("name") == name
                ],
            )


def _finished(outcomes: Sequence[tuple[Outcome, str]]) -> bool:
    """The run is over when every workload finished, or as soon as one failed."""
    return all(r[0] is not Outcome.PENDING for r in outcomes) or any(r[0] is Outcome.FAILED for r in outcomes)


class RunEnd(str, enum.Enum):
    """Why ``kelastic local run`` stopped watching."""

    FINISHED = "finished"
    TIMED_OUT = "timed out"
    INTERRUPTED = "interrupted"
    OPERATOR_EXITED = "operator exited"


def _watch(
    cluster: LocalCluster,
    waited: Sequence[dict[str, Any]],
    relay: LogRelay,
    stopper: _Stopper,
    args: argparse.Namespace,
    started: float,
    operator: _Operator | None,
    timeline: JobTimeline | None = None,
) -> tuple[list[tuple[Outcome, str]], RunEnd]:
    """Relay logs and report progress until the workloads finish; (last outcomes, why it ended)."""
    assert cluster.client is not None
    applier = Applier(cluster.client)
    # The workloads' output; not the operator's, when the chart runs it as a pod of its own namespace.
    namespaces = {str(o["metadata"].get("namespace") or "default") for o in waited}
    follower = LogFollower(cluster.data_dir, relay, namespaces, _containers_of(cluster))
    deadline = started + args.timeout
    outcomes: list[tuple[Outcome, str]] = []
    last_summary, last_print, next_status, next_sample = "", time.monotonic(), 0.0, 0.0
    jobs = [o for o in waited if o.get("kind") == "ElasticJob"]
    end = RunEnd.FINISHED
    while True:
        now = time.monotonic()
        follower.poll(time.time())
        if timeline is not None and jobs and now >= next_sample:
            _sample_jobs(cluster, applier, jobs, timeline)
            next_sample = now + 1.0
        if now >= next_status:
            outcomes = _poll_outcomes(cluster, applier, waited)
            next_status = now + 0.5
            if _finished(outcomes):
                break
            summary = ", ".join(f"{_describe(o)} {r[1]}" for o, r in zip(waited, outcomes, strict=True))
            if summary != last_summary or now - last_print >= args.progress_interval:
                relay.say(f"waiting ({now - started:.0f}s): {summary}")
                last_summary, last_print = summary, now
        sys.stdout.flush()
        if now >= deadline:
            end = RunEnd.TIMED_OUT
            break
        if operator is not None and operator.poll() is not None:
            end = RunEnd.OPERATOR_EXITED  # nothing would act on the workloads any more
            break
        if stopper.event.wait(0.2):
            end = RunEnd.INTERRUPTED
            break
    time.sleep(0.3)  # the last lines the containers wrote
    follower.poll(time.time())
    relay.flush()
    sys.stdout.flush()
    return outcomes, end


def _run_objects(manifest: Path) -> list[dict[str, Any]] | None:
    """The objects of ``kelastic local run``'s manifest, None (said on stderr) when it cannot
    run: unreadable, or holding nothing to wait for. A pod that never finishes is warned of."""
    try:
        objects = load_manifests([manifest])
    except ManifestError as exc:
        print(f"kelastic: {exc}", file=sys.stderr)
        return None
    if not any(waitable(o) for o in objects):
        print(
            f"kelastic: {manifest} holds no workload to wait for (only {', '.join(sorted({o['kind'] for o in objects}))})",
            file=sys.stderr,
        )
        return None
    for obj in objects:
        if obj["kind"] == "Pod" and (obj.get("spec") or {}).get("restartPolicy", "Always") == "Always":
            print(
                f"kelastic: warning: pod/{obj['metadata'].get('name')} has restartPolicy Always (the default), "
                "so it is restarted whenever it exits and never finishes; set restartPolicy: Never or OnFailure",
                file=sys.stderr,
            )
    return objects


def cmd_run(args: argparse.Namespace) -> int:
    out = sys.stdout
    manifest = Path(args.manifest)
    objects = _run_objects(manifest)
    if objects is None:
        return 2
    temp_dir = Path(tempfile.mkdtemp(prefix="kelastic-run-"))
    cluster = LocalCluster(
        temp_dir,
        workdir=Path.cwd(),
        backoff_base=args.backoff,
        control_plane=control_plane_dir(args.control_plane),
        progress=_progress(out),
        images=_images(args),
        gpus=args.gpus,
        cpus=args.cpus,
    )
    # One progress line per job: the job's own (its status), not each of its agents' as well.
    drop = _agent_progress_line if any(o.get("kind") == "ElasticJob" for o in objects) else None
    relay = LogRelay(write=out.write, tty=out.isatty(), interval=args.progress_interval, drop=drop)
    operator: _Operator | None = None
    stopper = _Stopper()
    started = time.monotonic()
    outcomes: list[tuple[Outcome, str]] = []
    waited: list[dict[str, Any]] = []
    pods: list[dict[str, Any]] = []
    end = RunEnd.INTERRUPTED
    operator_tail = ""
    timeline = JobTimeline()

    def notice(text: str) -> None:
        relay.say(text)
        out.flush()

    with stopper.installed():  # also during the clean-up: a second Ctrl-C must not break it off
        try:
            try:
                with stopper.interruptible():
                    cluster.start()
                    custom = [o for o in objects if "/" in str(o["apiVersion"]) and o["kind"] not in _FIRST]
                    if custom:
                        _apply_crds(cluster, out)
                        if not args.no_operator:
                            served = served_namespaces(args.watch_namespace, args.cluster_wide)
                            operator = _start_operator(cluster, out, *served, log_kept=args.keep)
                            if operator is None and not cluster.real:
                                kinds = ", ".join(sorted({o["kind"] for o in custom}))
                                notice(
                                    f"warning: the kelastic operator is not installed: nothing will act on {kinds}"
                                )
                    try:
                        applied = _apply_all(cluster, objects)
                    except Exception as exc:  # any refusal of the API server, named in the message
                        notice(f"could not apply {manifest}: {exc}")
                        return 2
            except Interrupted as exc:
                notice(f"{exc} while starting: stopping what was started")
            else:
                waited = [o for o in applied if waitable(o)]
                notice(
                    f"applied {len(applied)} object(s); waiting for {', '.join(_describe(o) for o in waited)}"
                )
                outcomes, end = _watch(cluster, waited, relay, stopper, args, started, operator, timeline)
                jobs = [o for o in waited if o.get("kind") == "ElasticJob"]
                if jobs and cluster.client is not None:
                    _sample_jobs(cluster, Applier(cluster.client), jobs, timeline)  # the final state
                    _job_events(cluster, jobs, timeline)
                if any(o.get("kind") != "Pod" for o in waited):
                    # The workloads' pods (not the operator's, installed in its own namespace).
                    namespaces = {str(o["metadata"].get("namespace") or "default") for o in waited}
                    pods = [p for p in _all_pods(cluster) if p["metadata"].get("namespace") in namespaces]
                if end is RunEnd.OPERATOR_EXITED and operator is not None:
                    lines = operator.log_path.read_text(errors="replace").splitlines()[-15:]
                    operator_tail = (
                        f"the operator exited with code {operator.poll()}; its last lines:\n"
                        + "\n".join(f"    {line}" for line in lines)
                    )
        finally:
            try:
                _stop_all(cluster, operator)
            finally:
                if args.keep:
                    print(f"kelastic: pod logs kept in {temp_dir}/pods", file=out, flush=True)
                else:
                    shutil.rmtree(temp_dir, ignore_errors=True)
    return _summarize(
        waited,
        outcomes,
        pods,
        time.monotonic() - started,
        end,
        operator_tail,
        args,
        out,
        timeline.lines(),
        signum=stopper.signal or signal.SIGINT,
    )


#: The agents' per-pod progress lines (``[<role> progress] step 120/300 ...``).
_AGENT_PROGRESS = re.compile(r"^\[[^\]\s]+ progress\] step \d")


def _agent_progress_line(prefix: str, text: str) -> bool:
    """A line of an agent's progress display (``kubectl logs`` still shows them)."""
    return bool(_AGENT_PROGRESS.match(text))


def _containers_of(cluster: LocalCluster) -> Callable[[str, str], int | None]:
    """How many containers (init containers included) a pod's spec has; None when it is gone."""

    def count(namespace: str, name: str) -> int | None:
        assert cluster.client is not None
        try:
            pod = cluster.call(
                cluster.client.get(f"/api/v1/namespaces/{namespace}/pods/{name}"),
                timeout=10.0,
                what=f"reading pod {name}",
            )
        except Exception:  # gone, or the cluster is stopping: the tag falls back to what wrote
            return None
        spec = pod.get("spec") or {}
        return len(spec.get("containers") or []) + len(spec.get("initContainers") or [])

    return count


def _pod_state(pod: dict[str, Any]) -> str:
    """A pod's phase and containers for the summary, which is printed once the cluster has
    stopped: a pod that had not finished by then (the rendezvous store, a pod being deleted)
    was stopped with it, whatever phase it had when it was listed."""
    phase = (pod.get("status") or {}).get("phase", "Pending")
    if phase in ("Succeeded", "Failed"):
        return f"{phase:<9}  {pod_outcome(pod)[1]}"
    deleting = ", being deleted" if (pod.get("metadata") or {}).get("deletionTimestamp") else ""
    return f"{'Stopped':<9}  stopped with the cluster (it was {phase}{deleting})"


def _all_pods(cluster: LocalCluster) -> list[dict[str, Any]]:
    """Every pod of the cluster (the workload's pods, for the summary)."""
    assert cluster.client is not None
    listing = cluster.call(cluster.client.get("/api/v1/pods"), timeout=30.0, what="listing the pods")
    return sorted(
        listing.get("items") or [], key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"]["name"])
    )


def _summarize(
    waited: Sequence[dict[str, Any]],
    outcomes: Sequence[tuple[Outcome, str]],
    pods: Sequence[dict[str, Any]],
    elapsed: float,
    end: RunEnd,
    operator_tail: str,
    args: argparse.Namespace,
    out: TextIO,
    job_lines: Sequence[str] = (),
    signum: int = signal.SIGINT,
) -> int:
    print("kelastic: summary", file=out)
    width = max((len(_describe(o)) for o in waited), default=0)
    # Interrupted before the first look: report every object as not observed.
    observed = list(outcomes) + [(Outcome.PENDING, "not observed")] * (len(waited) - len(outcomes))
    for obj, (outcome, detail) in zip(waited, observed, strict=True):
        # Still pending at the end: stopped with the cluster (a failure elsewhere, a timeout).
        label = "Unfinished" if outcome is Outcome.PENDING else outcome.value
        detail = detail.removeprefix(f"{label}: ")  # "Succeeded: training finished": said once
        print(f"  {_describe(obj):<{width}}  {label:<10}  {detail}", file=out)
    for line in job_lines:  # per ElasticJob: duration, restarts and causes, speed per world size
        print(line, file=out)
    if pods:
        print("  pods:", file=out)
        width = max(len(p["metadata"]["name"]) for p in pods)
        for pod in pods:
            print(f"    {pod['metadata']['name']:<{width}}  {_pod_state(pod)}", file=out)
    ok = end is RunEnd.FINISHED and bool(outcomes) and all(r[0] is Outcome.SUCCEEDED for r in outcomes)
    if end is RunEnd.TIMED_OUT:
        print(
            f"kelastic: FAILED: still not finished after --timeout {args.timeout:g}s; raise it for longer jobs",
            file=out,
        )
    elif end is RunEnd.INTERRUPTED:
        print("kelastic: interrupted; everything was stopped", file=out)
    elif end is RunEnd.OPERATOR_EXITED:
        print(f"kelastic: FAILED: {operator_tail}", file=out)
    else:
        verdict = "succeeded" if ok else "FAILED"
        print(f"kelastic: {verdict} in {elapsed:.1f}s", file=out)
    out.flush()
    if end is RunEnd.INTERRUPTED:
        return exit_code(signum)  # the shell convention for "stopped by a signal"
    return 0 if ok else 1


# -- entry point ----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kelastic", description="kelastic: elastic PyTorch training on Kubernetes"
    )
    groups = parser.add_subparsers(dest="group", required=True)
    local = groups.add_parser("local", help="a Kubernetes on this machine (API server + process kubelet)")
    commands = local.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run the local cluster in the foreground")
    up.add_argument(
        "--kubeconfig", type=Path, help="where to write the kubeconfig (default: <data dir>/kubeconfig)"
    )
    up.add_argument("--port", type=int, default=0, help="API server port on 127.0.0.1 (default: a free one)")
    up.add_argument(
        "--state-dir", type=Path, help="persist API objects here across restarts (default: memory)"
    )
    up.add_argument(
        "--data-dir", type=Path, help="pod logs and volumes (default: <state dir>/data or a temp dir)"
    )
    up.add_argument("--no-operator", action="store_true", help="do not start the kelastic operator")
    up.add_argument(
        "--kueue",
        nargs="?",
        const="auto",
        metavar="DIR",
        help="start Kueue's manager beside the operator (needs --control-plane); DIR is what `make kueue` "
        "printed (default: $KELASTIC_KUEUE, else the newest build), and the operator queues jobs labelled "
        "kueue.x-k8s.io/queue-name (docs/kueue.md)",
    )
    _control_plane_flag(up)
    _image_flag(up)
    _node_flags(up)
    up.add_argument(
        "--real-nodes",
        type=int,
        metavar="N",
        help="run N real nodes (the upstream kubelet, containerd, kube-router, kube-proxy; built by `make node`) "
        "beside the real control plane instead of the process kubelet; needs --control-plane and root "
        "(docs/real-nodes.md)",
    )
    up.add_argument(
        "--node-dir", type=Path, metavar="DIR", help="what `make node` printed (default: its cache)"
    )
    up.set_defaults(func=cmd_up)

    run = commands.add_parser("run", help="run a manifest to completion on a private local cluster")
    run.add_argument(
        "manifest", help="YAML file with the objects to apply (pods, ElasticJobs, services, ...)"
    )
    run.add_argument(
        "--timeout", type=float, default=3600.0, help="give up after this many seconds (default 3600)"
    )
    run.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        help="seconds between repeated status lines and progress-bar lines when not on a terminal",
    )
    run.add_argument("--backoff", type=float, default=10.0, help="first CrashLoopBackOff delay in seconds")
    run.add_argument(
        "--keep", action="store_true", help="keep the temporary data directory (logs) afterwards"
    )
    run.add_argument("--no-operator", action="store_true", help="do not start the kelastic operator")
    _control_plane_flag(run)
    _image_flag(run)
    _node_flags(run)
    run.set_defaults(func=cmd_run)
    return parser


def log_in_kelastic_voice(stream: TextIO | None = None) -> logging.Handler:
    """Print the warnings of the in-process cluster (API server, kubelet, controllers) as kelastic's own lines.

    Without a handler Python prints them bare, among the pods' ``[pod/container]``
    lines, where a user cannot tell who spoke. Returns the handler installed on
    the ``kelastic`` logger (the caller may remove it).
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("kelastic: %(message)s"))
    logger = logging.getLogger("kelastic")
    logger.addHandler(handler)
    return handler


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_in_kelastic_voice()
    try:
        return int(args.func(args))
    except (TimeoutError, RuntimeError, OSError) as exc:
        # Start-up failures (port in use, unwritable directory, ...): the message says it all.
        print(f"kelastic: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
