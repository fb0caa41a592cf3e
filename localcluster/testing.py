"""Test helpers for code that runs against ``kelastic local``: a cluster and the real kubectl.

Import the fixtures into a test module to use them::

    from kelastic.localcluster.testing import Kubectl, cluster_fixture, kubectl_fixture, wait_for  # noqa: F401

and name ``cluster``/``kubectl`` as test parameters. ``cluster`` is module-scoped (one LocalCluster per test module, CrashLoopBackOff
shortened to 1 s..4 s); ``kubectl`` runs the real binary against it. Requires pytest.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.localcluster.common import processes

__all__ = [
    "Kubectl",
    "KubectlApi",
    "cluster_fixture",
    "kubectl_fixture",
    "process_alive",
    "stop_process",
    "wait_for",
]

T = TypeVar("T")


class Kubectl:
    """The real kubectl binary pointed at one cluster."""

    def __init__(self, kubeconfig: Path) -> None:
        exe = shutil.which("kubectl")
        if exe is None:
            pytest.skip("kubectl is not installed (Debian package kubernetes-client)")
        self.exe = exe
        self.kubeconfig = kubeconfig

    def run(
        self, *args: str, timeout: float = 30.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """kubectl's whole answer (exit status, stdout, stderr), whatever it was."""
        return subprocess.run(
            [self.exe, "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )

    def __call__(
        self, *args: str, timeout: float = 30.0, check: bool = True, input: str | None = None
    ) -> str:
        proc = self.run(*args, timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}{proc.stdout}"
            )
        return proc.stdout

    def json(self, *args: str) -> dict[str, Any]:
        return json.loads(self("get", *args, "-o", "json"))

    def apply(self, manifest: str) -> str:
        """``kubectl apply`` of YAML text."""
        return self("apply", "-f", "-", input=manifest)

    def apply_object(self, obj: dict[str, Any]) -> str:
        """``kubectl apply`` of one object given as a dict (sent as JSON: no YAML quoting pitfalls)."""
        return self.apply(json.dumps(obj))


class KubectlApi(Kubectl):
    """An API server as kubectl users reach it (``kubectl --kubeconfig ...``), named for the
    messages of tests that compare two servers (the emulator and a real one)."""

    def __init__(self, name: str, kubeconfig: Path) -> None:
        super().__init__(kubeconfig)
        self.name = name

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.run(*args, timeout=60, input=stdin)

    def ok(self, *args: str, stdin: str | None = None) -> str:
        """kubectl's output; fails the test, quoting kubectl, when it fails."""
        done = self.kubectl(*args, stdin=stdin)
        assert done.returncode == 0, f"{self.name}: kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def said(self, *args: str, stdin: str | None = None) -> tuple[int, str]:
        """kubectl's exit status and all it printed (stdout, then stderr), stripped."""
        done = self.kubectl(*args, stdin=stdin)
        return done.returncode, (done.stdout + done.stderr).strip()


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def stop_process(
    proc: subprocess.Popen[Any],
    grace: float,
    *,
    kill_grace: float = 10.0,
    group: bool = False,
    sig: int = signal.SIGTERM,
) -> int:
    """Stop ``proc`` and reap it: ``sig``, up to ``grace`` s, then SIGKILL and ``kill_grace`` s more.

    With ``group`` the signals go to the process group ``proc`` leads (started with
    ``start_new_session=True``), so its children stop with it. Returns the exit code.
    The local cluster's own :func:`~kelastic.localcluster.common.processes.stop_process`.
    """
    return processes.stop_process(proc, grace, group=group, sig=sig, kill_grace=kill_grace)


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll ``check`` until it returns a truthy value; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module", name="cluster")
def cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("cluster")
    local = LocalCluster(data / "data", backoff_base=1.0, backoff_cap=4.0, workdir=data)
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module", name="kubectl")
def kubectl_fixture(cluster: LocalCluster) -> Kubectl:
    return Kubectl(cluster.kubeconfig)
