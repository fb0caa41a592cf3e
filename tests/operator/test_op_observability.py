"""Operating a job on kelastic local: both /metrics endpoints during a real run, the job's
NetworkPolicies, a worker evicted through the eviction API, a job whose ranks hang in a collective,
PodGroups for gang schedulers.

A LocalCluster (emulated API server, process kubelet), the operator as a subprocess
with ``--metrics-port`` and its NetworkPolicies (on by default), an ElasticJob whose workers train with real gloo and report
progress; a worker pod is deleted mid-run. The series are scraped over HTTP and read
with prometheus_client's parser, as a Prometheus server would.
"""

from __future__ import annotations

import json
import runpy
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

cluster_test = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("test_op_cluster.py"))))

pytestmark = pytest.mark.slow

# Trains until told to stop (a file appears); a lost peer fails the all-reduce, the agent re-forms.
# The ranks agree on the step they stop at (the all-reduce carries "stop"), so none is left alone
# in a collective when the others exit.
TRAIN = """
import os, sys, time
import torch, torch.distributed as dist
from kelastic.agent.progress import update
dist.init_process_group("gloo")
step = 0
while True:
    t = torch.tensor([1.0 if os.path.exists(sys.argv[1]) else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t.item() > 0:
        break
    step += 1
    update(step, 100000)
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
"""

HANG_WORKER = Path(__file__).parents[1] / "agent" / "scripts" / "hang_worker.py"
PODGROUP_CRDS = Path(__file__).parent / "crds" / "podgroups.yaml"

HEALTH_PORT = 30081  # the agents' health port; pods have addresses of their own (127.1.x)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def try_scrape(url: str) -> Samples | None:
    try:
        return scrape(url)
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kelastic.localcluster.cli.cluster import LocalCluster

    root = tmp_path_factory.mktemp("opmetrics")
    (root / "work").mkdir()
    (root / "work" / "train.py").write_text(TRAIN)
    (root / "work" / "hang_worker.py").write_text(HANG_WORKER.read_text())
    (root / "work" / "worker.py").write_text(cluster_test.WORKER_SCRIPT)
    cluster = LocalCluster(root / "data", workdir=root / "work")
    cluster.start()
    try:
        e = cluster_test.Env(Path(cluster.kubeconfig), root / "work")
        e.kubectl("apply", "-f", str(cluster_test.CRD))
        e.wait("the ElasticJob kind", lambda: "elasticjobs" in e.kubectl("api-resources", check=False))
        e.metrics_port = free_port()
        e.operator = cluster_test.start_operator(
            e,
            e.log,
            "--standalone",
            "--health-port",
            str(HEALTH_PORT),
            "--metrics-port",
            str(e.metrics_port),
            "--metrics-address",
            "127.0.0.1",
            "--operator-namespace",
            "default",
            "--operator-pod-labels",
            "app=kelastic-operator",
        )
        try:
            yield e
        finally:
            cluster_test.stop(e.operator)
            print(e.log.read_text()[-3000:])
    finally:
        cluster.stop()


def test_both_metrics_endpoints_during_a_run_with_a_lost_worker(env: Any) -> None:
    done = env.workdir / "metrics.done"
    # cold workers (a fresh interpreter per start): what is measured here is the metrics, not warm starts
    manifest = cluster_test.job("mx", min_r=2, max_r=3, replicas=3, warmStart=False)
    worker = manifest["spec"]["replicaSpecs"]["Worker"]
    worker["template"]["spec"]["containers"][0]["command"] = ["python", "train.py", str(done)]
    env.apply(manifest)
    operator_url = f"http://127.0.0.1:{env.metrics_port}/metrics"

    def status() -> dict[str, Any]:
        return env.get("ej", "mx").get("status") or {}

    env.wait(
        "world size 3 with progress", lambda: status().get("worldSize") == 3 and status().get("progress"), 120
    )
    op = env.wait(
        "the operator's series for the job",
        lambda: (
            (s := try_scrape(operator_url))
            and s.get(("kelastic_job_world_size", (("job", "mx"), ("namespace", "default")))) == 3
            and s
        ),
        30,
    )
    assert op[("kelastic_jobs", (("phase", "Running"),))] >= 1
    assert op[("kelastic_reconcile_total", ())] > 0
    assert op[("kelastic_reconcile_duration_seconds_count", ())] == op[("kelastic_reconcile_total", ())]

    pod_ip = env.get("pod", "mx-worker-0")["status"]["podIP"]
    agent_url = f"http://{pod_ip}:{HEALTH_PORT}/metrics"
    agent = env.wait(
        "the agent's step and rate",
        # the rate is over the last window's samples: two of the same step (a loaded machine) read 0
        lambda: (
            (s := try_scrape(agent_url))
            and s.get(("kelastic_agent_step", ()), 0) > 5
            and s.get(("kelastic_agent_steps_per_second", ()), 0) > 0
            and s
        ),
        60,
    )
    assert agent[("kelastic_agent_world_size", ())] == 3
    assert agent[("kelastic_agent_seconds_since_progress", ())] < 10
    assert agent[("kelastic_agent_steps_per_second", ())] > 0

    # a worker lost mid-run: the others re-form without it, the operator brings it back
    env.kubectl("delete", "pod", "mx-worker-2", "--grace-period=0", "--force")
    agent = env.wait(
        "the agent's recovery",
        lambda: (
            (s := try_scrape(agent_url))
            and s.get(("kelastic_agent_recovery_seconds_count", (("cause", "membership"),)), 0) >= 1
            and s
        ),
        90,
    )
    assert 0 < agent[("kelastic_agent_recovery_seconds_sum", (("cause", "membership"),))] < 60
    assert agent[("kelastic_agent_restarts_total", (("kind", "failure"),))] == 0
    op = env.wait(
        "the operator's recovery histogram",
        lambda: (
            (s := try_scrape(operator_url)) and s.get(("kelastic_recovery_seconds_count", ()), 0) >= 1 and s
        ),
        60,
    )
    assert 0 < op[("kelastic_recovery_seconds_sum", ())] < 60
    print(
        "metrics excerpt:",
        {
            k: v
            for k, v in op.items()
            if k[0].startswith(("kelastic_job", "kelastic_recovery_seconds_", "kelastic_jobs"))
        },
        {k: v for k, v in agent.items() if "bucket" not in k[0]},
    )
    done.write_text("")
    env.wait("Succeeded", lambda: status().get("phase") == "Succeeded", 90)
    op = env.wait(
        "the finished job in the phase counts",
        lambda: (
            (s := try_scrape(operator_url))
            and s.get(("kelastic_jobs", (("phase", "Succeeded"),)), 0) >= 1
            and s
        ),
        30,
    )
    assert op[("kelastic_jobs", (("phase", "Running"),))] == 0


def test_the_network_policies_follow_the_job(env: Any) -> None:
    """Created with the job, selecting its real store pod and workers, removed with the job; the job
    runs as usual (kelastic local, like a cluster without a NetworkPolicy provider, does not enforce them)."""
    env.apply(cluster_test.job("np", min_r=1, max_r=2, replicas=2))
    store = env.wait("the store's NetworkPolicy", lambda: env.get("networkpolicy", "np-rendezvous"), 60)
    workers = env.wait("the workers' NetworkPolicy", lambda: env.get("networkpolicy", "np-workers"), 60)
    uid = env.get("ej", "np")["metadata"]["uid"]
    for policy in (store, workers):
        assert [o["uid"] for o in policy["metadata"]["ownerReferences"]] == [uid]
    pods = env.wait("the store and 2 workers", lambda: len(p := env.pods("np")) == 3 and p, 60)

    def matching(selector: dict[str, Any]) -> list[str]:
        labels = selector["matchLabels"]
        return sorted(n for n, p in pods.items() if labels.items() <= p["metadata"]["labels"].items())

    # the operator: pods with its labels in its own namespace, which the emulator labels with its name
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}},
        "podSelector": {"matchLabels": {"app": "kelastic-operator"}},
    }
    assert matching(store["spec"]["podSelector"]) == ["np-rendezvous"]
    (rule,) = store["spec"]["ingress"]
    own, admitted_operator = rule["from"]
    assert matching(own["podSelector"]) == ["np-worker-0", "np-worker-1"] and "namespaceSelector" not in own
    assert admitted_operator == operator
    assert rule["ports"] == [{"protocol": "TCP", "port": 29400}]
    assert matching(workers["spec"]["podSelector"]) == ["np-worker-0", "np-worker-1"]
    among, health = workers["spec"]["ingress"]
    (peers,) = among["from"]
    assert "ports" not in among and matching(peers["podSelector"]) == ["np-worker-0", "np-worker-1"]
    assert health == {"from": [operator], "ports": [{"protocol": "TCP", "port": HEALTH_PORT}]}
    env.wait("Running", lambda: (env.get("ej", "np").get("status") or {}).get("phase") == "Running", 60)
    env.kubectl("delete", "ej", "np", "--wait=false")
    env.applied.discard("np")
    env.wait(
        "the garbage collector to remove the NetworkPolicies",
        lambda: (
            not {
                "networkpolicy.networking.k8s.io/np-rendezvous",
                "networkpolicy.networking.k8s.io/np-workers",
            }
            & set(env.kubectl("get", "networkpolicies", "-o", "name").split())
        ),
        60,
    )


def test_an_evicted_worker_shrinks_the_job_and_comes_back_without_spending_a_restart(env: Any) -> None:
    """The eviction API (policy/v1), as ``kubectl drain`` uses it, on a worker of a training job."""
    done = env.workdir / "evict.done"
    manifest = cluster_test.job("ev", min_r=2, max_r=3, replicas=3, warmStart=False, backoffLimit=0)
    manifest["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] = [
        "python", "train.py", str(done),
    ]  # fmt: skip

    def status() -> dict[str, Any]:
        return env.get("ej", "ev").get("status") or {}

    env.apply(manifest)
    env.wait(
        "world size 3 with progress", lambda: status().get("worldSize") == 3 and status().get("progress"), 120
    )
    before = env.get("pod", "ev-worker-1")["metadata"]["uid"]
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "ev-worker-1", "namespace": "default"},
    }
    env.kubectl(
        "create",
        "--raw",
        "/api/v1/namespaces/default/pods/ev-worker-1/eviction",
        "-f",
        "-",
        input=json.dumps(eviction),
    )
    cond = env.wait(
        "the Disrupted condition",
        lambda: next(
            (
                c
                for c in status().get("conditions") or []
                if c["type"] == "Disrupted" and c["status"] == "True"
            ),
            None,
        ),
        30,
    )
    assert cond["reason"] == "EvictionByEvictionAPI" and "ev-worker-1 was evicted" in cond["message"]
    events = env.wait(
        "the Event",
        lambda: [
            e
            for e in env.get("events")["items"]
            if e["involvedObject"].get("name") == "ev" and e["reason"] == "EvictionByEvictionAPI"
        ],
        30,
    )
    assert events[0]["type"] == "Warning" and "not counted against spec.backoffLimit" in events[0]["message"]
    # recreated under the same name, the group back at 3; backoffLimit 0 was not touched
    env.wait(
        "a new ev-worker-1",
        lambda: (p := env.pods("ev").get("ev-worker-1")) is not None and p["metadata"]["uid"] != before,
        60,
    )
    env.wait("world size 3 again", lambda: status().get("worldSize") == 3, 120)
    st = status()
    assert st["phase"] in ("Running", "Restarting") and int(st.get("backoffCount") or 0) == 0
    env.wait(
        "the condition to clear",
        lambda: any(
            c["type"] == "Disrupted" and c["status"] == "False" for c in status().get("conditions") or []
        ),
        60,
    )
    agent = scrape(f"http://{env.get('pod', 'ev-worker-0')['status']['podIP']}:{HEALTH_PORT}/metrics")
    assert agent[("kelastic_agent_restarts_total", (("kind", "failure"),))] == 0
    done.write_text("")
    env.wait("Succeeded", lambda: status().get("phase") == "Succeeded", 90)


def test_a_hang_in_a_collective_restarts_the_group_and_names_the_ranks(env: Any) -> None:
    """spec.hangTimeoutSeconds: rank 1 stops, rank 0 blocks in its all-reduce; the agents restart the
    group (a restart spent), the job's Stalled condition names the ranks, and the second attempt succeeds."""
    manifest = cluster_test.job("hang", min_r=2, max_r=2, replicas=2, warmStart=False, hangTimeoutSeconds=5)
    manifest["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] = [
        "python", "hang_worker.py", "--out", str(env.workdir), "--hang-at", "5", "--steps", "5",
    ]  # fmt: skip

    def status() -> dict[str, Any]:
        return env.get("ej", "hang").get("status") or {}

    env.apply(manifest)
    cond = env.wait(
        "the Stalled condition",
        lambda: next(
            (c for c in status().get("conditions") or [] if c["type"] == "Stalled" and c["status"] == "True"),
            None,
        ),
        180,
    )
    assert cond["reason"] == "NoProgress" and "spec.hangTimeoutSeconds=5" in cond["message"]
    assert "rank(s) 0, 1" in cond["message"] or "rank(s) 0" in cond["message"]
    events = [
        e
        for e in env.get("events")["items"]
        if e["involvedObject"].get("name") == "hang" and e["reason"] == "NoProgress"
    ]
    assert events and events[0]["type"] == "Warning"
    try:
        st = env.wait("an end", lambda: (s := status()).get("phase") in ("Succeeded", "Failed") and s, 180)
    except AssertionError:
        st = status()
    if st.get("phase") != "Succeeded":
        logs = {name: env.kubectl("logs", name, "--tail", "40", check=False) for name in env.pods("hang")}
        pytest.fail(
            f"the job is {st.get('phase')}: {json.dumps(st, indent=1)}\npod logs: {json.dumps(logs, indent=1)}"
        )
    assert int(st.get("restarts") or 0) >= 1  # the hang spent a restart


def test_podgroups_follow_the_job_through_scale_and_deletion(env: Any) -> None:
    """With the PodGroup CRDs installed: Volcano's and scheduler-plugins' PodGroups, their fields,
    the pods that name them, minMember on scale, garbage collection with the job."""
    env.kubectl("apply", "-f", str(PODGROUP_CRDS))
    env.wait("the PodGroup kinds", lambda: "scheduling.x-k8s.io" in env.kubectl("api-resources", check=False))
    volcano_pg, cosched_pg = "podgroups.scheduling.volcano.sh", "podgroups.scheduling.x-k8s.io"

    def maybe_get(kind: str, name: str) -> dict[str, Any] | None:
        out = env.kubectl("get", kind, name, "-o", "json", check=False)
        return json.loads(out) if out.strip() else None

    gang = cluster_test.job(
        "gang",
        min_r=2,
        max_r=4,
        replicas=4,
        schedulingPolicy={"minAvailable": 3, "queue": "research", "priorityClass": "high"},
    )
    gang["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["schedulerName"] = "volcano"
    env.apply(gang)
    group = env.wait("the Volcano PodGroup", lambda: maybe_get(volcano_pg, "gang"), 60)
    assert group["spec"] == {"minMember": 3, "queue": "research", "priorityClassName": "high"}
    assert [o["uid"] for o in group["metadata"]["ownerReferences"]] == [
        env.get("ej", "gang")["metadata"]["uid"]
    ]
    pods = env.wait(
        "4 workers",
        lambda: len(p := {n: x for n, x in env.pods("gang").items() if "worker" in n}) == 4 and p,
        60,
    )
    assert all(p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gang" for p in pods.values())
    assert "scheduling.k8s.io/group-name" not in (
        env.get("pod", "gang-rendezvous")["metadata"].get("annotations") or {}
    )
    env.kubectl("scale", "ej", "gang", "--replicas", "2")
    env.wait(
        "minMember to follow the scale", lambda: env.get(volcano_pg, "gang")["spec"]["minMember"] == 2, 60
    )

    cosched = cluster_test.job(
        "cosched", min_r=2, max_r=3, replicas=3, schedulingPolicy={"scheduleTimeoutSeconds": 90}
    )
    cosched["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["schedulerName"] = (
        "scheduler-plugins-scheduler"
    )
    env.apply(cosched)
    group = env.wait("the coscheduling PodGroup", lambda: maybe_get(cosched_pg, "cosched"), 60)
    assert group["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 90}  # minReplicas, not the 3 replicas
    env.wait(
        "a labelled worker",
        lambda: (
            (p := env.pods("cosched").get("cosched-worker-0"))
            and p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "cosched"
        ),
        60,
    )

    env.kubectl("delete", "ej", "gang", "cosched", "--wait=false")
    env.applied.difference_update({"gang", "cosched"})
    env.wait(
        "both PodGroups to go with their jobs",
        lambda: (
            not env.kubectl("get", volcano_pg, "-o", "name").strip()
            and not env.kubectl("get", cosched_pg, "-o", "name").strip()
        ),
        60,
    )
