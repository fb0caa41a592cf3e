"""Test configuration shared by ``tests/`` and ``e2e/``: where the real control plane's binaries are.

Tests that run kube-apiserver, etcd, kube-controller-manager and kube-scheduler
(``kelastic local --control-plane``) take the ``control_plane_bin`` fixture. It
looks in ``$KELASTIC_CONTROL_PLANE``, then ``$KUBEBUILDER_ASSETS``, then in what
``make control-plane`` built (the newest complete ``~/.cache/kelastic/k8s/*/bin``,
or under ``$KELASTIC_K8S_CACHE``). Without any of them the test is skipped with a
reason that says how to enable it.

Tests that ask the same question of the emulator and of a real kube-apiserver with the
real kubectl take ``kubectl_api``: a module-scoped fixture run once per server (the
emulator alone, or the real control plane of ``control_plane_bin``).

When the chosen directory holds a ``kubectl``, it goes first on the session's
``PATH``: every test (of either lane) then drives the cluster with the kubectl of
that release, as its users would.

Every test picks its lane explicitly: the variables are read once and then removed
from the test processes' environment, so a ``kelastic local`` started without
``--control-plane`` runs the emulator even where CI exports ``$KELASTIC_CONTROL_PLANE``
(otherwise the emulator lane would silently become a second control-plane lane, and
tests that stop the API server's process group would stop the wrong processes).

Tests marked ``gpu`` (tests/gpu/, e2e/test_e2e_gpu.py) need CUDA, NCCL and at least
:data:`GPUS_NEEDED` GPUs (or the ``gpus=`` of their marker); elsewhere they are skipped with a
reason that says so (see docs/gpus.md). The GPUs are counted without initialising CUDA in the test process.

torch's ``TCPStore`` looks up the name of each address it connects to or accepts from (a
loopback address in its IPv4-mapped form is not in /etc/hosts, so the query goes to the DNS
server): where that server loses a query now and then, the lookup waits out the resolver's
timeout, 5 s by default, and a store connect with a timeout of 5 s or less fails. The tests
take 1 s (``$RES_OPTIONS``, unless set already; their processes inherit it): such a loss costs
a second, not a failed or 5 s slower test.

At its end a run prints what its tests not marked ``slow`` (the fast subset) took, setup and
teardown included, one after the other: so the full run's log (CI's) also says what the fast
subset costs, which ``-m "not slow" -n 2`` spreads over two processes.

With ``-n`` (pytest-xdist) each test process takes whole modules (``--dist loadfile`` unless
``--dist`` is given), the longest first by ``tests/module_seconds.json``, which
``--record-module-seconds`` writes: a module's fixtures start once, and the suite does not end
on a long module started last. The lane variables above reach the test processes too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported where used: the test session starts without the local cluster
    from kelastic.localcluster.testing import KubectlApi

REPO = Path(__file__).resolve().parent
ENABLE = (
    "no Kubernetes control-plane binaries. Build them with `make control-plane` (kube-apiserver, "
    "kube-controller-manager, kube-scheduler, kubectl v1.37.2 and etcd from the Go module proxy, with Go 1.26+: "
    "about 15 minutes on two cores the first time; the tests then find ~/.cache/kelastic/k8s/v1.37.2/bin by "
    "themselves), or take the Kubernetes release binaries (https://dl.k8s.io/release/v1.37.2/bin/linux/amd64/"
    "kube-apiserver, and the same for the other three) and etcd from https://github.com/etcd-io/etcd/releases, "
    "or run envtest's `setup-envtest use -p path` (go install sigs.k8s.io/controller-runtime/tools/"
    "setup-envtest@latest), which fetches kube-apiserver and etcd only, so the lane runs without the "
    "controller-manager and scheduler. Then set KELASTIC_CONTROL_PLANE (or KUBEBUILDER_ASSETS) to the "
    "directory holding them"
)
#: Where ``make control-plane`` builds (localcluster/controlplane/build.sh): <root>/<version>/bin.
BUILT = Path(os.environ.get("KELASTIC_K8S_CACHE") or Path.home() / ".cache" / "kelastic" / "k8s")
MARKER = ".kelastic-complete"


VARIABLES = ("KELASTIC_CONTROL_PLANE", "KUBEBUILDER_ASSETS")
#: The variables' values pass to pytest-xdist's test processes, which start after the
#: variables were removed, under this prefix, which nothing in kelastic reads.
KEPT = "KELASTIC_TESTS_KEPT_"
_from_environment: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")
    for variable in VARIABLES:
        value = os.environ.pop(variable, None)
        if value is None:
            value = os.environ.get(KEPT + variable)
        if value is not None:
            _from_environment.setdefault(variable, value)
            os.environ[KEPT + variable] = value
    found = _named_or_built()
    if found is not None and (found / "kubectl").is_file():
        os.environ["PATH"] = f"{found}{os.pathsep}{os.environ.get('PATH', '')}"


_fast_subset: dict[str, float] = {}
_module_seconds: dict[str, float] = {}

#: What each test module took in a full run, setup and teardown included (written by
#: ``--record-module-seconds``): the order in which test processes take modules.
MODULE_SECONDS = REPO / "tests" / "module_seconds.json"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-module-seconds",
        metavar="PATH",
        help=f"write what each test module took in this run to PATH (JSON); {MODULE_SECONDS.relative_to(REPO)} "
        "holds a full run's, and runs with -n take the longest modules first",
    )


#: Modules whose tests share one test process, one module after another: each real-node module
#: starts a lane, and test_realnode_cleanup.py checks that the host holds nothing of any lane
#: once its own is gone, which is only true where no other lane runs meanwhile.
ONE_PROCESS = {"tests/localcluster/test_realnode_": "the real-node lane's modules"}


def module_of(nodeid: str) -> str:
    """The path of the module a test's node id names."""
    return nodeid.split("::")[0]


def process_scope(nodeid: str) -> str:
    """What one test process takes whole with ``-n``: the test's module, or its group in :data:`ONE_PROCESS`."""
    module = module_of(nodeid)
    return next((group for prefix, group in ONE_PROCESS.items() if module.startswith(prefix)), module)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.option.dist != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return process_scope(nodeid)

    return ModuleScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """With ``-n``, whole modules go to a test process, longest first.

    A module's fixtures (a control plane, a Kueue manager, a real-node lane) then start once,
    in one process, and the long modules do not end the run alone; the modules of
    :data:`ONE_PROCESS` go to one process together. ``--dist`` given on the command line is kept.
    """
    option = config.option
    if getattr(option, "numprocesses", None) and getattr(option, "dist", "no") == "no":
        option.dist = "loadfile"
        option.loadscopereorder = False


def longest_modules_first(items: list[pytest.Item]) -> None:
    """Modules longest first by :data:`MODULE_SECONDS`; a module it does not name goes first.

    The sort is stable, so each module's tests keep the order pytest gave them (its
    fixtures' scopes and parameters). Every test process sorts alike, as pytest-xdist needs.
    """
    try:
        known: dict[str, float] = json.loads(MODULE_SECONDS.read_text())
    except (OSError, ValueError):
        known = {}
    unknown = max(known.values(), default=0.0) + 1.0
    items.sort(key=lambda item: -known.get(module_of(item.nodeid), unknown))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" not in report.keywords:
        _fast_subset[report.nodeid] = _fast_subset.get(report.nodeid, 0.0) + report.duration
    module = module_of(report.nodeid)
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("record_module_seconds")
    if path and not hasattr(session.config, "workerinput"):  # the controller has every report
        seconds = {module: round(value, 1) for module, value in sorted(_module_seconds.items())}
        Path(path).write_text(json.dumps(seconds, indent=1) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _fast_subset:
        terminalreporter.write_line(
            f"the fast subset (tests not marked slow) in this run: {len(_fast_subset)} tests, "
            f"{sum(_fast_subset.values()):.1f} s one after the other"
        )


def built_control_plane() -> Path | None:
    """The newest complete directory ``make control-plane`` built, if any."""

    def release(path: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", path.parent.name)[:3])

    done = [
        p.parent
        for p in BUILT.glob(f"v*/bin/{MARKER}")
        if re.fullmatch(r"v\d+\.\d+\.\d+", p.parent.parent.name)
    ]
    return max(done, key=release) if done else None


def _named_or_built() -> Path | None:
    for variable in VARIABLES:
        value = _from_environment.get(variable) or os.environ.get(variable)
        if value:
            return Path(value)
    return built_control_plane()


def find_control_plane_bin() -> tuple[Path | None, str]:
    """(the binaries' directory, or None and why not)."""
    for variable in VARIABLES:
        value = _from_environment.get(variable) or os.environ.get(variable)
        if value:
            path = Path(value)
            if (path / "kube-apiserver").is_file():
                return path, ""
            return None, f"${variable}={value} holds no kube-apiserver; {ENABLE}"
    built = built_control_plane()
    if built is not None:
        return built, ""
    return None, ENABLE


@pytest.fixture(scope="session")
def control_plane_bin() -> Path:
    """The directory of the real control plane's binaries (skips the test when there is none)."""
    path, why = find_control_plane_bin()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture(scope="module", params=["emulator", "kube-apiserver"])
def kubectl_api(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KubectlApi]:
    """The emulator's API server, then a real control plane's (skipped without binaries)."""
    from kelastic.localcluster.testing import KubectlApi

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "emulator":
        from kelastic.localcluster.apiserver.apiserver import ApiServer

        api = ApiServer(data_dir=root)
        api.start()
        try:
            yield KubectlApi(request.param, Path(api.write_kubeconfig(root / "kubeconfig")))
        finally:
            api.stop()
        return
    directory = request.getfixturevalue("control_plane_bin")  # skips, saying how, without binaries
    from kelastic.localcluster.controlplane.controlplane import ControlPlane, ControlPlaneBinaries

    with ControlPlane(ControlPlaneBinaries.find(directory), root / "plane") as plane:
        yield KubectlApi(request.param, plane.admin_kubeconfig)


#: The GPUs the ``gpu`` lane needs: most scenarios run at least two agents, one GPU each;
#: a test that needs fewer says so with ``@pytest.mark.gpu(gpus=1)``.
GPUS_NEEDED = 2


def gpu_lane_missing(needed: int = GPUS_NEEDED) -> str | None:
    """Why a ``gpu`` test needing ``needed`` GPUs cannot run here, or None when it can."""
    import torch.distributed as dist

    from kelastic.agent.devices import cuda_device_count

    try:
        found = cuda_device_count()
    except RuntimeError as exc:
        return f"needs CUDA and at least {needed} GPUs (counting them failed: {exc})"
    if found < needed:
        return (
            f"needs CUDA and at least {needed} GPU{'s' if needed > 1 else ''} (found {found}): "
            "run on a GPU machine with `python3 -m pytest -m gpu`"
        )
    if not dist.is_nccl_available():
        return f"needs a torch build with NCCL (found {found} GPUs, but torch.distributed has no NCCL)"
    return None


@pytest.hookimpl(trylast=True)  # after pytest ordered each module's tests by fixture
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_modules_first(items)
    reasons: dict[int, str | None] = {}
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = int(marker.kwargs.get("gpus", GPUS_NEEDED))
        if needed not in reasons:
            reasons[needed] = gpu_lane_missing(needed)
        why = reasons[needed]
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=why))
