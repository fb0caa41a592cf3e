"""End-to-end: what keeps a job's network to the job (docs/security.md), on the real control
plane, whose admission mounts service-account tokens and labels namespaces as a cluster does
(the emulator's answers are compared with it in tests/localcluster), and on a real cluster.

One job runs through the chart-installed operator; while it trains:

* its Secret exists (one, owned by the job, 64 hex digits), every worker pod mounts it
  read-only where its agent's ``--job-secret-file`` points, and (on kelastic local, where
  pods are processes) every agent reads the same value from a file of the mode asked for;
* no worker pod mounts a service-account token, and no agent gets API credentials;
* its two NetworkPolicies exist, owned by the job, selecting its real pods, admitting the
  chart's operator by its namespace (by name where the API server labels namespaces so, as
  the emulator and Kubernetes 1.21+ do; from any namespace on v1.20, which does not);

and once the job is deleted, the Secret and the policies go with it. See conftest.py for
the clusters this runs on.
"""

from __future__ import annotations

import base64
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.slow

SECRET_FLAG = "--job-secret-file"
MOUNT_DIR = "/var/run/secrets/kelastic.dev/job"
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return dict(selector["matchLabels"]).items() <= labels.items()


def agent_processes(pod_uid: str) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, environment) of the agents whose secret file lies in the pod's own directory
    (kelastic local: a pod's volumes are directories named after it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            environ = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if SECRET_FLAG in argv and pod_uid in argv[argv.index(SECRET_FLAG) + 1]:
            found.append((argv, dict(e.partition("=")[::2] for e in environ if "=" in e)))
    return found


@pytest.mark.lanes("control-plane")
def test_a_jobs_secret_policies_and_tokens(kel: Any) -> None:
    name = "e2e-sec"
    job = kel.apply_job(kel.job_manifest(name, replicas=2, min_replicas=2, max_replicas=2, steps=4000))
    uid = job["metadata"]["uid"]
    kel.wait_phase(name, "Running", timeout=240)
    selector = f"kelastic.dev/job-name={name}"

    # -- the Secret -------------------------------------------------------------------------
    (secret,) = kel.kubectl.json("get", "secrets", "-l", selector)["items"]
    meta = secret["metadata"]
    assert meta["name"] == f"{name}-secret-{re.sub('[^a-z0-9]', '', uid)[:8]}"
    (owner,) = meta["ownerReferences"]
    assert (owner["uid"], owner["kind"], owner["controller"]) == (uid, "ElasticJob", True)
    assert secret.get("immutable") is True and set(secret["data"]) == {"job-secret"}
    value = base64.b64decode(secret["data"]["job-secret"])
    assert re.fullmatch(rb"[0-9a-f]{64}", value), "256 random bits as 64 hex digits"

    workers = kel.pods(name, role="worker")
    assert len(workers) == 2
    for pod in workers:
        spec = pod["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "kelastic-job-secret"]
        (source,) = volume["projected"]["sources"]
        assert source["secret"]["name"] == meta["name"]
        # the example's pods have an fsGroup: the file is the group's to read, no one else's
        assert volume["projected"]["defaultMode"] == 0o440
        main = spec["containers"][0]
        assert {"name": "kelastic-job-secret", "mountPath": MOUNT_DIR, "readOnly": True} in main[
            "volumeMounts"
        ]
        assert main["command"][main["command"].index(SECRET_FLAG) + 1] == f"{MOUNT_DIR}/job-secret"
        # -- no service-account token ----------------------------------------------------------
        assert spec.get("automountServiceAccountToken") is False
        mounts = [
            m
            for c in spec["containers"] + spec.get("initContainers", [])
            for m in c.get("volumeMounts") or []
        ]
        assert not [m for m in mounts if m["mountPath"].rstrip("/") == TOKEN_DIR], mounts
        tokens = [
            v
            for v in spec["volumes"]
            if "serviceAccountToken" in str(v.get("projected")) or "-token-" in str(v.get("secret"))
        ]
        assert tokens == []
        if kel.local:
            # every agent reads the job's one value, from a file of the mode the pod asks for
            (agent, environ), *_ = agent_processes(pod["metadata"]["uid"]) or [(None, None)]
            assert agent is not None, f"no agent of {pod['metadata']['name']} found"
            path = Path(agent[agent.index(SECRET_FLAG) + 1])
            assert path.read_bytes() == value
            assert stat.S_IMODE(path.stat().st_mode) == 0o440
            # no credentials for the API server either: the kubelet hands a pod without a token a
            # kubeconfig that names none (so no client falls back to someone else's)
            kubeconfig = (
                yaml.safe_load(Path(environ["KUBECONFIG"]).read_text()) if "KUBECONFIG" in environ else {}
            )
            assert not (kubeconfig or {}).get("users"), kubeconfig

    # -- the NetworkPolicies ------------------------------------------------------------------
    policies = {
        p["metadata"]["name"]: p for p in kel.kubectl.json("get", "networkpolicies", "-l", selector)["items"]
    }
    assert set(policies) == {f"{name}-workers", f"{name}-rendezvous"}
    for policy in policies.values():
        assert [o["uid"] for o in policy["metadata"]["ownerReferences"]] == [uid]
    pods = {p["metadata"]["name"]: p["metadata"]["labels"] for p in kel.pods(name)}
    worker_names = sorted(n for n in pods if "-worker-" in n)

    def chosen(policy: dict[str, Any]) -> list[str]:
        return sorted(n for n, labels in pods.items() if labels_match(policy["spec"]["podSelector"], labels))

    namespace = kel.kubectl.namespace
    ns_labels = kel.kubectl.json("get", "namespace", namespace)["metadata"].get("labels") or {}
    by_name = ns_labels.get("kubernetes.io/metadata.name") == namespace
    operator_ns = {"matchLabels": {"kubernetes.io/metadata.name": namespace}} if by_name else {}
    workers_policy, store_policy = policies[f"{name}-workers"], policies[f"{name}-rendezvous"]
    assert chosen(workers_policy) == worker_names and chosen(store_policy) == [f"{name}-rendezvous"]
    among, health = workers_policy["spec"]["ingress"]
    assert "ports" not in among
    assert sorted(
        n for n, labels in pods.items() if labels_match(among["from"][0]["podSelector"], labels)
    ) == (worker_names)
    (operator,) = health["from"]
    assert operator["namespaceSelector"] == operator_ns
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert health["ports"] == [{"protocol": "TCP", "port": 8081}]
    (rule,) = store_policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 29400}] and rule["from"][1] == operator

    # -- gone with the job ---------------------------------------------------------------------
    kel.delete_job(name)

    def everything_gone() -> bool:
        left = [
            f"{kind}/{o['metadata']['name']}"
            for kind in ("secrets", "networkpolicies")
            for o in kel.kubectl.json("get", kind, "-l", selector)["items"]
        ]
        if left:
            raise kel.LastSeen(left)
        return True

    kel.wait_for("the garbage collector to remove the job's Secret and NetworkPolicies", everything_gone, 90)
