"""The real-node lane: the real control plane v1.37.2 and two real nodes (the upstream kubelet,
containerd, runc, the CNI bridge, kube-router's firewall, kube-proxy in nftables mode).

- pods on both nodes reach each other and a ClusterIP, ``kubectl logs`` and ``exec`` work
  through the kubelets' serving certificates, a pod that asks a kubelet's API anonymously is
  refused, and nothing beyond the lane is routable;
- a Guaranteed pod runs under the runtime's default seccomp profile and is OOM-killed past its
  memory limit;
- the NetworkPolicies the operator builds for a job, applied as it builds them, are enforced
  by kube-router against an attacker: a pod of another namespace wearing the job's labels and
  a pod of another job are refused on every port class of docs/security.md, the job's own pods
  and the operator get through, and the same probes all succeed with the policies removed.

Needs root, ``make node``, ``make control-plane`` and the netfilter tools; elsewhere each test
is skipped with a reason that says what is missing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kelastic.agent import contract
from kelastic.operator.builders import BuildConfig, store_pod, worker_pod
from kelastic.operator.netpol import NetworkPolicyConfig, store_network_policy, workers_network_policy
from kelastic.operator.spec import parse_job

from .realnode_harness import LISTENER, PROBE, Lane, debian_pod, pod_ip, running_lane, wait_pods_ready

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
JOB_NS, OTHER_NS, OPERATOR_NS = "team-a", "team-b", "kelastic-system"
OPERATOR_LABELS = {"app.kubernetes.io/name": "kelastic", "app.kubernetes.io/component": "operator"}
#: One port per class of docs/security.md's table (the ephemeral ones fixed for the test).
WORKER_PORTS = {
    "checkpoint service": 41234,
    "peer link": 41235,
    "health": contract.DEFAULT_HEALTH_PORT,
    "round's worker store": 29500,
    "gloo": 41236,
}
STORE_PORT = contract.DEFAULT_RDZV_PORT
#: An anonymous request to a kubelet's API (port 10250) from a pod; prints the status line.
KUBELET_PROBE = """
import socket, ssl, sys
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
with ctx.wrap_socket(socket.create_connection((sys.argv[1], 10250), timeout=5)) as s:
    s.sendall(b"GET /pods HTTP/1.1\\r\\nHost: kubelet\\r\\nConnection: close\\r\\n\\r\\n")
    print(s.recv(256).split(b"\\r\\n")[0].decode())
"""


@pytest.fixture(scope="module")
def lane(control_plane_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lane]:
    with running_lane(control_plane_bin, tmp_path_factory.mktemp("realnode")) as running:
        yield running


def probe(lane: Lane, namespace: str, pod: str, targets: list[tuple[str, int]]) -> list[bool]:
    out = lane.kubectl("exec", "-n", namespace, pod, "--", "python3", "-c", PROBE, json.dumps(targets))
    return list(json.loads(out.strip().splitlines()[-1]))


def test_pods_reach_each_other_across_nodes_and_nothing_beyond(lane: Lane) -> None:
    n1, n2 = lane.node_names()
    lane.kubectl("create", "namespace", "net")
    lane.apply(
        debian_pod("server", "net", n1, {"app": "server"}, LISTENER, ["8080"]),
        debian_pod("client", "net", n2, {"app": "client"}, LISTENER),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "server", "namespace": "net"},
            "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    wait_pods_ready(lane, ["net"])
    server = pod_ip(lane, "net", "server")
    cluster_ip = lane.kubectl("get", "svc", "-n", "net", "server", "-o", "jsonpath={.spec.clusterIP}")
    deadline = time.monotonic() + 60
    while True:  # kube-proxy programs the Service a moment after its EndpointSlice
        reached = probe(
            lane, "net", "client", [(server, 8080), (cluster_ip, 80), ("192.0.2.2", 22), ("1.1.1.1", 53)]
        )
        if reached[1] or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert reached == [True, True, False, False], f"pod IP, ClusterIP, host's address, internet: {reached}"
    routes = lane.kubectl("exec", "-n", "net", "client", "--", "cat", "/proc/net/route")
    assert not any(line.split()[1] == "00000000" for line in routes.splitlines()[1:]), (
        f"a default route:\n{routes}"
    )
    # A stranger (any pod) at a kubelet's API: no credentials, no answer but 401.
    assert lane.nodes.plan is not None
    kubelet = str(lane.nodes.plan.nodes[0].address)
    status = lane.kubectl("exec", "-n", "net", "client", "--", "python3", "-c", KUBELET_PROBE, kubelet)
    assert status.strip() == "HTTP/1.1 401 Unauthorized", status
    logs = lane.kubectl("logs", "-n", "net", "server")
    assert logs == "", "the listener prints nothing; kubectl logs went through the kubelet's TLS server"


def test_the_runtime_enforces_seccomp_and_the_memory_limit(lane: Lane) -> None:
    n1, _ = lane.node_names()
    program = (
        "import sys\n"
        "print([l for l in open('/proc/self/status') if l.startswith('Seccomp:')][0].strip(), flush=True)\n"
        "hog = b'x' * (256 << 20)\n"
        "print('survived', len(hog), flush=True)\n"
    )
    pod = debian_pod("hog", "default", n1, {"app": "hog"}, program)
    limits = {"cpu": "200m", "memory": "64Mi"}
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["securityContext"] = {"seccompProfile": {"type": "RuntimeDefault"}}
    pod["spec"]["containers"][0]["resources"] = {"requests": limits, "limits": limits}
    lane.apply(pod)
    deadline = time.monotonic() + 120
    reason = ""
    while not reason and time.monotonic() < deadline:
        time.sleep(1)
        reason = lane.kubectl(
            "get", "pod", "hog", "-o", "jsonpath={.status.containerStatuses[0].state.terminated.reason}"
        )
    logs = lane.kubectl("logs", "hog")
    assert reason == "OOMKilled", f"the container ended as {reason!r}; its log: {logs}"
    assert "Seccomp:\t2" in logs and "survived" not in logs, logs
    assert lane.kubectl("get", "pod", "hog", "-o", "jsonpath={.status.qosClass}") == "Guaranteed"


def _job(lane: Lane) -> Any:
    lane.kubectl("apply", "-f", str(REPO / "crds"))
    lane.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    for ns in (JOB_NS, OTHER_NS, OPERATOR_NS):
        lane.kubectl("create", "namespace", ns)
    manifest = {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": "train", "namespace": JOB_NS},
        "spec": {
            "minReplicas": 2,
            "maxReplicas": 2,
            "replicaSpecs": {
                "Worker": {
                    "replicas": 2,
                    "template": {
                        "spec": {
                            "containers": [{"name": "trainer", "image": "x", "command": ["python", "t.py"]}]
                        }
                    },
                }
            },
        },
    }
    lane.apply(manifest)
    return parse_job(json.loads(lane.kubectl("get", "ej", "-n", JOB_NS, "train", "-o", "json")))


def test_network_policies_refuse_strangers_on_every_port(lane: Lane) -> None:
    n1, n2 = lane.node_names()
    job = _job(lane)
    config = BuildConfig()
    worker_labels = worker_pod(job, 0, endpoint="h:1", config=config)["metadata"]["labels"]
    store_labels = store_pod(job, config=config)["metadata"]["labels"]
    other_job = dict(worker_labels, **{contract.LABEL_JOB_NAME: "other"})
    ports = [str(p) for p in WORKER_PORTS.values()]
    lane.apply(
        debian_pod("train-worker-0", JOB_NS, n1, worker_labels, LISTENER, ports),
        debian_pod("train-worker-1", JOB_NS, n2, worker_labels, LISTENER, ports),
        debian_pod("train-rendezvous", JOB_NS, n2, store_labels, LISTENER, [str(STORE_PORT)]),
        debian_pod("operator", OPERATOR_NS, n1, OPERATOR_LABELS, LISTENER),
        debian_pod("intruder", OTHER_NS, n1, worker_labels, LISTENER),  # the job's labels, elsewhere
        debian_pod("other-job", JOB_NS, n2, other_job, LISTENER),
    )
    wait_pods_ready(lane, [JOB_NS, OTHER_NS, OPERATOR_NS])
    worker0, store = pod_ip(lane, JOB_NS, "train-worker-0"), pod_ip(lane, JOB_NS, "train-rendezvous")
    targets = [(worker0, p) for p in WORKER_PORTS.values()] + [(store, STORE_PORT)]
    names = [*WORKER_PORTS, "rendezvous store"]
    health = [name == "health" for name in WORKER_PORTS]
    sources = {  # (namespace, pod): what it may reach under the policies
        (JOB_NS, "train-worker-1"): [True] * len(targets),
        (OPERATOR_NS, "operator"): [*health, True],
        (OTHER_NS, "intruder"): [False] * len(targets),
        (JOB_NS, "other-job"): [False] * len(targets),
    }

    def matrix() -> dict[tuple[str, str], list[bool]]:
        return {source: probe(lane, *source, targets) for source in sources}

    def settle(want: dict[tuple[str, str], list[bool]], what: str) -> dict[tuple[str, str], list[bool]]:
        deadline = time.monotonic() + 60
        while (got := matrix()) != want and time.monotonic() < deadline:
            time.sleep(2)  # kube-router follows the policies within seconds
        return got

    def table(got: dict[tuple[str, str], list[bool]]) -> str:
        return "\n".join(
            f"  {ns}/{pod}: "
            + ", ".join(f"{n}={'reached' if ok else 'refused'}" for n, ok in zip(names, row, strict=True))
            for (ns, pod), row in got.items()
        )

    everyone = {source: [True] * len(targets) for source in sources}
    got = settle(everyone, "no policies")
    assert got == everyone, f"without NetworkPolicies every probe must get through:\n{table(got)}"

    on = NetworkPolicyConfig(True, OPERATOR_LABELS, OPERATOR_NS)
    policies = [
        workers_network_policy(job, health_port=contract.DEFAULT_HEALTH_PORT, config=on),
        store_network_policy(job, port=STORE_PORT, config=on),
    ]
    lane.apply(*policies)
    got = settle(sources, "policies on")
    print("with the operator's NetworkPolicies (kube-router v2.1.0):\n" + table(got))
    assert got == sources, f"with the operator's NetworkPolicies:\n{table(got)}"

    for policy in policies:
        lane.kubectl("delete", "networkpolicy", "-n", JOB_NS, policy["metadata"]["name"])
    got = settle(everyone, "policies off again")
    assert got == everyone, f"with the NetworkPolicies deleted again:\n{table(got)}"
