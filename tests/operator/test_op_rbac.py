"""The operator under the chart's ServiceAccount and RBAC, on a real kube-apiserver.

The emulator grants everything, so only a real API server (RBAC on, the
OwnerReferencesPermissionEnforcement admission plugin) can show that the chart's
Role misses a rule. Here the chart is installed with the real Helm library, the
operator runs as a process with the chart's ServiceAccount token (no kubelet is
needed: the job's pods only have to be created), and a job must get its store,
Service and workers, with no 403 anywhere in the operator's log.

Binaries: ``$KELASTIC_CONTROL_PLANE``, ``$KUBEBUILDER_ASSETS``, or in this
repository's test set-up ``../shared/k8s/unpack.sh`` beside the checkout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kelastic.agent import contract
from kelastic.localcluster.testing import Kubectl, stop_process

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kelastic"

pytestmark = pytest.mark.slow


class RealCluster:
    def __init__(self, plane: Any, root: Path) -> None:
        self.plane = plane
        self.root = root
        self.admin = plane.admin_kubeconfig
        self.kubectl = Kubectl(self.admin)

    def service_account_kubeconfig(self, namespace: str, account: str) -> Path:
        """A kubeconfig holding a TokenRequest token of ``account`` (what the kubelet mounts)."""
        from kelastic.localcluster.controlplane.controlplane import write_kubeconfig

        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}
        answer = json.loads(
            self.kubectl(
                "create",
                "--raw",
                f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
                "-f",
                "-",
                input=json.dumps(request),
            )
        )
        path = self.root / f"{namespace}-{account}.kubeconfig"
        user = f"system:serviceaccount:{namespace}:{account}"
        return write_kubeconfig(
            path, self.plane.url, self.plane.ca_file, user, token=answer["status"]["token"]
        )


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, control_plane_bin: Path) -> Iterator[RealCluster]:
    directory = control_plane_bin  # skips, saying how to enable it, when there are no binaries
    from kelastic.localcluster.controlplane.controlplane import ControlPlane, ControlPlaneBinaries

    root = tmp_path_factory.mktemp("rbac")
    plane = ControlPlane(ControlPlaneBinaries.find(directory), root / "plane", progress=print)
    plane.start()
    try:
        yield RealCluster(plane, root)
    finally:
        plane.stop()


def job(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": 3,
            "replicaSpecs": {
                "Worker": {
                    "replicas": 2,
                    "template": {
                        "spec": {
                            "containers": [
                                {"name": "trainer", "image": "kelastic:dev", "command": ["python", "t.py"]}
                            ]
                        }
                    },
                }
            },
        },
    }


def run_under_chart_rbac(
    real: RealCluster, *, cluster_wide: bool, release: str, job_namespace: str, queue: str | None = None
) -> None:
    """``queue``: the chart with ``kueue.enabled`` and a job in that LocalQueue (Kueue running)."""
    from kelastic.localcluster.cli.chart import install_chart, uninstall_chart

    chart = install_chart(
        real.admin,
        CHART,
        f"{release}-system",
        {"kueue": {"enabled": True}} if queue else None,
        release=release,
        watch_namespaces=() if cluster_wide else (job_namespace,),
        cluster_wide=cluster_wide,
        wait=None,  # no kubelet here: the test runs the operator itself, with the chart's identity
    )
    if cluster_wide:
        real.kubectl("create", "namespace", job_namespace)
    (account,) = [o["metadata"]["name"] for o in chart.objects if o["kind"] == "ServiceAccount"]
    (deployment,) = [o for o in chart.objects if o["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    kubeconfig = real.service_account_kubeconfig(chart.namespace, account)
    log = real.root / f"{release}-operator.log"
    # The Deployment's own arguments (scope, lease, ...), without the endpoints that would bind
    # ports on this machine (liveness, metrics).
    argv = [a for a in args if not a.startswith(("--liveness", "--metrics-"))]
    operator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kelastic.operator",
            "--kubeconfig",
            str(kubeconfig),
            "--health-port",
            "0",
            *argv,
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    started = time.monotonic()
    body = job("rbac", job_namespace)
    if queue:
        assert "--kueue" in argv, argv
        body["metadata"]["labels"] = {
            "kueue.x-k8s.io/queue-name": queue,
            "kueue.x-k8s.io/priority-class": "rbac",
        }
        # Kueue assigns a flavor per resource requested: the workers ask for cpu.
        trainer = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        trainer["resources"] = {"requests": {"cpu": "100m"}}
    try:
        real.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
        deadline = time.monotonic() + 90
        names: set[str] = set()
        while time.monotonic() < deadline and len(names) < 3:
            items = json.loads(
                real.kubectl(
                    "get", "pods", "-n", job_namespace, "-l", f"{contract.LABEL_JOB_NAME}=rbac", "-o", "json"
                )
            )["items"]
            names = {p["metadata"]["name"] for p in items}
            time.sleep(0.3)
        elapsed = time.monotonic() - started
        text = log.read_text(errors="replace")
        assert names == {"rbac-rendezvous", "rbac-worker-0", "rbac-worker-1"}, (
            f"after {elapsed:.0f}s the operator under the chart's RBAC created {sorted(names)}; log:\n{text[-4000:]}"
        )
        print(
            f"{'cluster-wide' if cluster_wide else 'namespaced'}: 3 pods {elapsed:.1f}s after operator start"
        )
        assert "Forbidden" not in text and " 403" not in text, text[-4000:]
        # It read its own Namespace (the chart's Role in the release namespace) to choose how the
        # NetworkPolicies select it: by name where the API server labels namespaces with it.
        assert "could not read namespace" not in text
        assert (
            f"namespace {chart.namespace} has no label" in text
            or f"from namespace {chart.namespace} only" in text
        )
        # The job's Secret (create is all the chart grants) and both NetworkPolicies, all owned by the job.
        uid = json.loads(real.kubectl("get", "ej", "-n", job_namespace, "rbac", "-o", "json"))["metadata"][
            "uid"
        ]
        selector = f"{contract.LABEL_JOB_NAME}=rbac"
        owned_kinds = [
            ("secrets", {f"rbac-secret-{uid[:8]}"}),
            ("networkpolicies", {"rbac-rendezvous", "rbac-workers"}),
        ]
        if "podgroups.scheduling.k8s.io" in real.kubectl(
            "api-resources", "--api-group=scheduling.k8s.io", "-o", "name"
        ):
            # kube-scheduler's own gang: the job's PodGroup, which its workers name.
            owned_kinds.append(("podgroups.scheduling.k8s.io", {"rbac"}))
            assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "rbac"} for p in items[1:]), items
        if queue:
            # Kueue: the job's base Workload, admitted; the workers are what it admitted.
            owned_kinds.append(("workloads.kueue.x-k8s.io", {f"rbac-{uid[:8]}-base"}))
        for kind, expected in owned_kinds:
            owned = json.loads(real.kubectl("get", kind, "-n", job_namespace, "-l", selector, "-o", "json"))[
                "items"
            ]
            assert {o["metadata"]["name"] for o in owned} == expected, kind
            assert all(o["metadata"]["ownerReferences"][0]["uid"] == uid for o in owned), kind
        if queue:
            status = json.loads(real.kubectl("get", "ej", "-n", job_namespace, "rbac", "-o", "json"))[
                "status"
            ]
            assert status["queue"]["admitted"] == 2, status
            # The Workload carries the priority the operator read from the WorkloadPriorityClass.
            (workload,) = json.loads(
                real.kubectl(
                    "get", "workloads.kueue.x-k8s.io", "-n", job_namespace, "-l", selector, "-o", "json"
                )
            )["items"]
            assert workload["spec"].get("priority") == 7, workload["spec"]
            # The workers run where the ResourceFlavor says (the operator read it under the chart's RBAC).
            for worker in items:
                if worker["metadata"]["name"] != "rbac-rendezvous":
                    assert worker["spec"]["nodeSelector"] == {"pool": "rbac-pool"}, worker["spec"]
                    assert {
                        "key": "dedicated",
                        "operator": "Equal",
                        "value": "training",
                        "effect": "NoSchedule",
                    } in (worker["spec"]["tolerations"]), worker["spec"]
        pod = items[0]
        assert pod["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] is True
        real.kubectl("get", "service", "-n", job_namespace, "rbac-rendezvous")
        status = json.loads(real.kubectl("get", "ej", "-n", job_namespace, "rbac", "-o", "json")).get(
            "status"
        )
        assert status and status.get("phase"), "the operator could not write the job's status"
        events = json.loads(real.kubectl("get", "events", "-n", job_namespace, "-o", "json"))["items"]
        assert any(e["source"].get("component") == "kelastic-operator" for e in events)
        # The chart's NetworkPolicy of the operator pod, applied by the real API server.
        policy = json.loads(
            real.kubectl(
                "get", "networkpolicy", "-n", chart.namespace, f"{release}-kelastic-operator", "-o", "json"
            )
        )
        assert policy["spec"]["ingress"][0]["ports"][0]["port"] == 8080, policy
        lease_name = next(a.split("=", 1)[1] for a in argv if a.startswith("--lease-name="))
        lease = json.loads(real.kubectl("get", "lease", "-n", chart.namespace, lease_name, "-o", "json"))
        assert lease["spec"]["holderIdentity"], "the operator never held its Lease"
    finally:
        stop_process(operator, 10, group=True)
        real.kubectl("delete", "ej", "rbac", "-n", job_namespace, "--wait=false", "--ignore-not-found")
        uninstall_chart(chart)


def test_namespaced_chart_rbac_lets_the_operator_create_a_jobs_pods(real: RealCluster) -> None:
    run_under_chart_rbac(real, cluster_wide=False, release="kelns", job_namespace="team-a")


def test_cluster_wide_chart_rbac_lets_the_operator_create_a_jobs_pods(real: RealCluster) -> None:
    run_under_chart_rbac(real, cluster_wide=True, release="kelcw", job_namespace="team-b")


KUEUE_QUOTA = """
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata:
  name: rbac-flavor
spec:
  nodeLabels:
    pool: rbac-pool
  tolerations:
  - {key: dedicated, operator: Equal, value: training, effect: NoSchedule}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata:
  name: rbac-cq
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [cpu]
    flavors:
    - name: rbac-flavor
      resources:
      - name: cpu
        nominalQuota: "4"
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: WorkloadPriorityClass
metadata:
  name: rbac
value: 7
"""


def test_chart_rbac_with_kueue_enabled_lets_the_operator_queue_a_job(
    real: RealCluster, tmp_path: Path
) -> None:
    """kueue.enabled: the operator under the chart's RBAC watches, creates and reads Workloads and
    their priority class, and creates the admitted workers; no 403."""
    from kelastic.localcluster.kueue import KueueBinaries, KueueManager, KueueUnsupported, find_kueue_dir

    found = find_kueue_dir()
    if found is None or not (found / "bin" / "kueue").is_file():
        pytest.skip("no Kueue build: run `make kueue` (or set KELASTIC_KUEUE to such a directory)")
    manager = KueueManager(KueueBinaries.find(found), real.plane, tmp_path / "kueue")
    try:
        manager.start()
    except KueueUnsupported as exc:
        pytest.skip(str(exc))
    try:
        real.kubectl("create", "namespace", "team-q")
        local_queue = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": "rbac-q", "namespace": "team-q"},
            "spec": {"clusterQueue": "rbac-cq"},
        }
        real.kubectl("apply", "-f", "-", input=KUEUE_QUOTA + "---\n" + yaml.safe_dump(local_queue))
        run_under_chart_rbac(real, cluster_wide=False, release="kelq", job_namespace="team-q", queue="rbac-q")
    finally:
        manager.stop()
