"""Pod Security admission in the API server emulator: the standards' checks and Kubernetes' messages."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.localcluster.apiserver.podsecurity import Level, forbidden_message, level_of, violations

# What a real API server answers for a plain nginx pod in a restricted namespace (the
# message Kubernetes documents and users quote).
NGINX_RESTRICTED = (
    'pods "bad-pod" is forbidden: violates PodSecurity "restricted:latest": '
    'allowPrivilegeEscalation != false (container "nginx" must set securityContext.allowPrivilegeEscalation=false), '
    'unrestricted capabilities (container "nginx" must set securityContext.capabilities.drop=["ALL"]), '
    'runAsNonRoot != true (pod or container "nginx" must set securityContext.runAsNonRoot=true), '
    'seccompProfile (pod or container "nginx" must set securityContext.seccompProfile.type to "RuntimeDefault" '
    'or "Localhost")'
)

RESTRICTED_SC = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}


def nginx() -> dict[str, Any]:
    return {"containers": [{"name": "nginx", "image": "nginx"}]}


def test_plain_pod_in_restricted_namespace_gets_kubernetes_message() -> None:
    found = violations(nginx(), Level.RESTRICTED)
    assert forbidden_message("bad-pod", Level.RESTRICTED, "latest", found) == NGINX_RESTRICTED
    assert violations(nginx(), Level.BASELINE) == []  # baseline allows root
    assert violations({"hostNetwork": True, **nginx()}, Level.PRIVILEGED) == []


def test_several_containers_are_named_together() -> None:
    spec = {
        "initContainers": [{"name": "init", "image": "x"}],
        "containers": [{"name": "a", "image": "x", "securityContext": RESTRICTED_SC}],
    }
    (escalation, caps, non_root, _seccomp) = violations(spec, Level.RESTRICTED)
    assert escalation.endswith('(container "init" must set securityContext.allowPrivilegeEscalation=false)')
    assert 'pod or containers "init", "a" must set' in non_root and '"a"' not in caps
    spec["containers"].append({"name": "b", "image": "x"})
    assert 'containers "init", "b" must set' in violations(spec, Level.RESTRICTED)[0]


def test_baseline_checks() -> None:
    spec = {
        "hostNetwork": True,
        "containers": [
            {
                "name": "c",
                "image": "x",
                "securityContext": {"privileged": True, "capabilities": {"add": ["NET_ADMIN", "CHOWN"]}},
                "ports": [{"containerPort": 80, "hostPort": 80}],
            }
        ],
        "volumes": [{"name": "data", "hostPath": {"path": "/data"}}],
    }
    assert violations(spec, Level.BASELINE) == [
        'non-default capabilities (container "c" must not include "NET_ADMIN" in securityContext.capabilities.add)',
        "host namespaces (hostNetwork=true)",
        'hostPath volumes (volume "data")',
        'hostPort (container "c" uses hostPort 80)',
        'privileged (container "c" must not set securityContext.privileged=true)',
    ]
    # Under restricted the volume check is the stricter "restricted volume types".
    assert 'restricted volume types (volume "data" uses restricted volume type "hostPath")' in violations(
        spec, Level.RESTRICTED
    )


def test_a_compliant_pod_passes_restricted() -> None:
    spec = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [{"name": "c", "image": "x", "securityContext": RESTRICTED_SC}],
        "volumes": [
            {"name": "d", "emptyDir": {}},
            {"name": "p", "persistentVolumeClaim": {"claimName": "x"}},
        ],
    }
    assert violations(spec, Level.RESTRICTED) == []
    spec["containers"][0]["securityContext"] = {**RESTRICTED_SC, "runAsUser": 0}
    assert violations(spec, Level.RESTRICTED) == ['runAsUser=0 (container "c" must not set runAsUser=0)']


def test_level_from_namespace_labels() -> None:
    assert level_of({}) == (Level.PRIVILEGED, "latest")
    labels = {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "v1.30",
    }
    assert level_of(labels) == (Level.RESTRICTED, "v1.30")


def test_what_the_operator_adds_passes_restricted() -> None:
    from kelastic.operator.builders import BuildConfig, inject_init_container, store_pod
    from kelastic.operator.spec import parse_job

    body = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u"},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": 1,
            "replicaSpecs": {
                "Worker": {"replicas": 1, "template": {"spec": {"containers": [nginx()["containers"][0]]}}}
            },
        },
    }
    body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] = [
        "python",
        "t.py",
    ]
    assert violations(store_pod(parse_job(body), config=BuildConfig())["spec"], Level.RESTRICTED) == []
    init_only = {"containers": [inject_init_container(BuildConfig())]}
    assert violations(init_only, Level.RESTRICTED) == []


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_emulator_refuses_pods_the_namespace_label_forbids(api: ApiServer) -> None:
    kubeconfig = api.data_dir / "kubeconfig"
    assert kubectl(kubeconfig, "create", "namespace", "locked").returncode == 0
    labelled = kubectl(
        kubeconfig, "label", "namespace", "locked", "pod-security.kubernetes.io/enforce=restricted"
    )
    assert labelled.returncode == 0, labelled.stderr
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bad-pod"}, "spec": nginx()}
    refused = kubectl(kubeconfig, "-n", "locked", "apply", "-f", "-", stdin=yaml.safe_dump(pod))
    assert refused.returncode == 1
    assert f'Error from server (Forbidden): error when creating "STDIN": {NGINX_RESTRICTED}' in refused.stderr
    # The same pod is fine in a namespace without the label, and dry runs are judged too.
    assert kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump(pod)).returncode == 0
    dry = kubectl(
        kubeconfig, "-n", "locked", "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(pod)
    )
    assert dry.returncode == 1 and "violates PodSecurity" in dry.stderr


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_hostpath_is_refused_from_baseline_up(api: ApiServer, level: str) -> None:
    kubeconfig = api.data_dir / "kubeconfig"
    ns = f"ns-{level}"
    kubectl(kubeconfig, "create", "namespace", ns)
    kubectl(kubeconfig, "label", "namespace", ns, f"pod-security.kubernetes.io/enforce={level}")
    spec = nginx()
    spec["volumes"] = [{"name": "data", "hostPath": {"path": "/tmp"}}]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hp"}, "spec": spec}
    refused = kubectl(kubeconfig, "-n", ns, "apply", "-f", "-", stdin=yaml.safe_dump(pod))
    assert refused.returncode == 1 and f'violates PodSecurity "{level}:latest"' in refused.stderr
    assert 'volume "data"' in refused.stderr
