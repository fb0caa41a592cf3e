"""The real lanes' cluster: a real control plane, the process kubelet, Kueue's manager when asked,
the ElasticJob CRD, and the operator as a process. Loaded with ``runpy`` by the lane modules."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kelastic.localcluster.cli.cluster import LocalCluster
from kelastic.localcluster.kueue import KueueBinaries, KueueManager, KueueUnsupported, find_kueue_dir
from kelastic.localcluster.testing import Kubectl, stop_process

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Lane:
    cluster: LocalCluster
    kubectl: Kubectl
    #: Kueue's manager, when the lane runs one (the operator then runs with --kueue).
    kueue: KueueManager | None


def kueue_build() -> Path | None:
    """The Kueue build ``make kueue`` made (or ``$KELASTIC_KUEUE``), None without one."""
    found = find_kueue_dir()
    return found if found is not None and (found / "bin" / "kueue").is_file() else None


@contextlib.contextmanager
def real_lane(
    control_plane_bin: Path,
    data: Path,
    *,
    kueue: Path | None = None,
    wait_for_pods_ready: float | None = None,
    kueue_optional: bool = False,
    cpus: str | None = None,
) -> Iterator[Lane]:
    """The lane's cluster, with Kueue's manager from ``kueue`` (a build directory) when given.
    Where the API server refuses Kueue's CRDs the module is skipped, saying why, unless
    ``kueue_optional`` (the lane then runs without Kueue)."""
    cluster = LocalCluster(
        data / "data",
        control_plane=control_plane_bin,
        workdir=REPO,
        backoff_base=1.0,
        backoff_cap=4.0,
        cpus=cpus,
    )
    cluster.start(timeout=120)
    manager: KueueManager | None = None
    operator: subprocess.Popen[bytes] | None = None
    try:
        assert cluster.control_plane is not None
        if kueue is not None:
            try:
                manager = KueueManager(
                    KueueBinaries.find(kueue),
                    cluster.control_plane,
                    data / "kueue",
                    wait_for_pods_ready=wait_for_pods_ready,
                ).start()
            except KueueUnsupported as exc:
                if not kueue_optional:
                    pytest.skip(str(exc))
        kubectl = Kubectl(cluster.kubeconfig)
        kubectl("apply", "-f", str(REPO / "crds" / "elasticjob.yaml"))
        log = open(data / "operator.log", "wb")  # noqa: SIM115 - lives as long as the operator
        operator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kelastic.operator",
                f"--kubeconfig={cluster.kubeconfig}",
                "--standalone",
                "--all-namespaces",
                *(["--kueue"] if manager is not None else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        yield Lane(cluster, kubectl, manager)
    finally:
        if operator is not None:
            stop_process(operator, 10.0)
        if manager is not None:
            manager.stop()
        cluster.stop()
