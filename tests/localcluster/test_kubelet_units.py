"""Pure parts of the process kubelet: env, argv, status, back-off, IPs, endpoints, proxy tables."""

from __future__ import annotations

import base64
import os
import stat
import sys
import sysconfig
from pathlib import Path

import pytest

from kelastic.localcluster.common.ipam import IpAllocator, IpExhaustedError, claim_networks
from kelastic.localcluster.controllers.endpoints import compute_subsets
from kelastic.localcluster.controllers.proxy import ready_backends, service_listeners
from kelastic.localcluster.kubelet.podenv import (
    ContainerConfigError,
    PodContext,
    expand,
    resolve_command,
    resolve_env,
)
from kelastic.localcluster.kubelet.podstatus import (
    ContainerRecord,
    ContainerState,
    CrashBackoff,
    PodFacts,
    PodPhase,
    Terminated,
    pod_phase,
    pod_status,
    should_restart,
)
from kelastic.localcluster.kubelet.probes import ProbeKind, ProbeResult, ProbeSpec, ProbeTracker, resolve_port
from kelastic.localcluster.kubelet.volumes import mount_env, prepare_volumes, volume_env_name

POD = {
    "metadata": {
        "name": "w-0",
        "namespace": "team",
        "uid": "u-1",
        "labels": {"app": "train", "tier": "x"},
        "annotations": {"note": "hi"},
    },
    "spec": {"nodeName": "kelastic-local", "serviceAccountName": "sa"},
}
CTX = PodContext(pod_ip="127.1.0.7", node_name="kelastic-local")


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$$(A)", env) == "$(A)"
    assert expand("$(MISSING) $(A", env) == "$(MISSING) $(A"
    assert expand("cost $5 and $$", env) == "cost $5 and $"


def test_env_field_refs_and_expansion() -> None:
    container = {
        "name": "c",
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "LABELS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels"}}},
            {"name": "NOTE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['note']"}}},
            {"name": "ADDR", "value": "$(POD_IP):29400/$(POD_NAME)/$(LATER)"},
            {"name": "LATER", "value": "x"},
        ],
    }
    env = resolve_env(POD, container, CTX)
    assert env["POD_NAME"] == "w-0" and env["POD_NS"] == "team" and env["POD_UID"] == "u-1"
    assert env["POD_IP"] == "127.1.0.7" and env["NODE"] == "kelastic-local"
    assert env["APP"] == "train" and env["NOTE"] == "hi"
    assert env["LABELS"] == 'app="train"\ntier="x"'
    # Only earlier definitions are visible to expansion.
    assert env["ADDR"] == "127.1.0.7:29400/w-0/$(LATER)"


def test_env_from_configmaps_and_secrets_with_precedence() -> None:
    ctx = PodContext(
        pod_ip="127.1.0.7",
        node_name="n",
        configmaps={"cfg": {"LR": "0.1", "STEPS": "10"}},
        secrets={"s": {"TOKEN": base64.b64encode(b"t0k").decode()}},
        provided={"HOSTNAME": "w-0"},
    )
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cfg"}}, {"secretRef": {"name": "s"}, "prefix": "S_"}],
        "env": [
            {"name": "LR", "value": "0.5"},
            {"name": "ONE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "STEPS"}}},
            {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k", "optional": True}}},
            {"name": "H", "value": "$(HOSTNAME)"},
        ],
    }
    env = resolve_env(POD, container, ctx)
    assert env["LR"] == "0.5" and env["STEPS"] == "10" and env["ONE"] == "10"
    assert env["S_TOKEN"] == "t0k" and env["H"] == "w-0" and "OPT" not in env


def test_env_errors_name_what_is_missing() -> None:
    with pytest.raises(ContainerConfigError, match='configmap "gone" not found'):
        resolve_env(POD, {"name": "c", "envFrom": [{"configMapRef": {"name": "gone"}}]}, CTX)
    with pytest.raises(ContainerConfigError, match="unsupported fieldRef"):
        resolve_env(
            POD,
            {"name": "c", "env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.x"}}}]},
            CTX,
        )


def test_command_resolution() -> None:
    env = {"POD_IP": "127.1.0.9"}
    argv = resolve_command(
        {"name": "c", "command": ["python3", "-m", "x"], "args": ["--addr", "$(POD_IP)"]}, env
    )
    assert argv == [sys.executable, "-m", "x", "--addr", "127.1.0.9"]
    assert resolve_command({"name": "c", "args": ["echo", "hi"]}, env) == ["echo", "hi"]
    assert resolve_command({"name": "c", "command": ["python3.11"]}, env) == [sys.executable]
    with pytest.raises(ContainerConfigError, match="neither command nor args"):
        resolve_command({"name": "c"}, env)


def test_console_scripts_of_this_environment_are_found_without_path() -> None:
    # An image's entry points are this environment's console scripts, even when
    # the kubelet's PATH does not name the environment's scripts directory.
    scripts = sysconfig.get_path("scripts")
    argv = resolve_command({"name": "c", "command": ["kelastic-rendezvous", "--port", "1"]}, {})
    assert argv == [os.path.join(scripts, "kelastic-rendezvous"), "--port", "1"]
    assert resolve_command({"name": "c", "command": ["no-such-tool-here"]}, {}) == ["no-such-tool-here"]


def _term(code: int) -> Terminated:
    return Terminated(
        exit_code=code, reason="Completed" if code == 0 else "Error", started_at=1.0, finished_at=2.0
    )


def _rec(
    state: ContainerState, code: int | None = None, last: int | None = None, init: bool = False
) -> ContainerRecord:
    rec = ContainerRecord(name="c", image="img", init=init, state=state)
    if code is not None:
        rec.terminated = _term(code)
    if last is not None:
        rec.last_terminated = _term(last)
    return rec


@pytest.mark.parametrize(
    ("policy", "records", "phase"),
    [
        ("Never", [_rec(ContainerState.WAITING)], PodPhase.PENDING),
        ("Never", [_rec(ContainerState.RUNNING)], PodPhase.RUNNING),
        ("Never", [_rec(ContainerState.TERMINATED, 0)], PodPhase.SUCCEEDED),
        ("Never", [_rec(ContainerState.TERMINATED, 0), _rec(ContainerState.TERMINATED, 1)], PodPhase.FAILED),
        ("OnFailure", [_rec(ContainerState.TERMINATED, 0)], PodPhase.SUCCEEDED),
        ("OnFailure", [_rec(ContainerState.WAITING, last=1)], PodPhase.RUNNING),
        ("Always", [_rec(ContainerState.TERMINATED, 0)], PodPhase.RUNNING),
        ("Never", [_rec(ContainerState.RUNNING), _rec(ContainerState.WAITING)], PodPhase.PENDING),
    ],
)
def test_pod_phase(policy: str, records: list[ContainerRecord], phase: PodPhase) -> None:
    assert pod_phase(policy, [], records) is phase


def test_init_containers_gate_the_phase() -> None:
    main = [_rec(ContainerState.WAITING)]
    assert pod_phase("Always", [_rec(ContainerState.RUNNING, init=True)], main) is PodPhase.PENDING
    assert pod_phase("Never", [_rec(ContainerState.TERMINATED, 1, init=True)], main) is PodPhase.FAILED
    assert pod_phase("OnFailure", [_rec(ContainerState.TERMINATED, 1, init=True)], main) is PodPhase.PENDING


def test_status_conditions_and_container_statuses() -> None:
    facts = PodFacts(restart_policy="Never", pod_ip="127.1.0.3", host_ip="127.0.0.1", start_time=5.0)
    running = _rec(ContainerState.RUNNING)
    running.started_at = 6.0
    running.ready = True
    status = pod_status(facts, [_rec(ContainerState.TERMINATED, 0, init=True)], [running], now=10.0)
    conds = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Running" and status["podIP"] == "127.1.0.3"
    assert {k: conds[k]["status"] for k in conds} == {
        "Initialized": "True",
        "Ready": "True",
        "ContainersReady": "True",
        "PodScheduled": "True",
    }
    assert status["containerStatuses"][0]["state"] == {"running": {"startedAt": "1970-01-01T00:00:06Z"}}
    assert status["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
    # Transition times move only when a condition's status changes.
    done = pod_status(
        PodFacts("Never", "127.1.0.3", "127.0.0.1", 5.0, previous_conditions=status["conditions"]),
        [],
        [_rec(ContainerState.TERMINATED, 0)],
        now=20.0,
    )
    conds2 = {c["type"]: c for c in done["conditions"]}
    assert done["phase"] == "Succeeded"
    assert conds2["Ready"]["status"] == "False" and conds2["Ready"]["reason"] == "PodCompleted"
    assert conds2["Ready"]["lastTransitionTime"] == "1970-01-01T00:00:20Z"
    assert conds2["PodScheduled"]["lastTransitionTime"] == "1970-01-01T00:00:10Z"


def test_restart_policy_and_backoff() -> None:
    assert should_restart("Always", 0) and should_restart("OnFailure", 1)
    assert not should_restart("OnFailure", 0) and not should_restart("Never", 1)
    assert not should_restart("Always", 0, init=True)
    backoff = CrashBackoff(base=10, cap=40)
    delays = [backoff.delay_after_exit("c", ran_for=1) for _ in range(6)]
    assert delays == [0, 10, 20, 40, 40, 40]
    assert backoff.delay_after_exit("c", ran_for=100) == 0  # ran long enough: start over


def test_ip_allocation() -> None:
    ipam = IpAllocator()
    a, b = ipam.allocate("p1"), ipam.allocate("p2")
    assert a == "127.1.0.2" and b == "127.1.0.3"
    ipam.release(a)
    assert ipam.allocate("p3") == "127.1.0.4"  # not reused before wrapping
    assert ipam.reserve("127.1.9.9", "p4") and not ipam.reserve("127.1.9.9", "p5")
    assert not ipam.reserve("127.0.0.1", "p6")
    import ipaddress

    tiny = IpAllocator(ipaddress.IPv4Network("127.1.0.0/30"))
    tiny.allocate("x")
    with pytest.raises(IpExhaustedError):
        tiny.allocate("y")


def test_probe_tracking_and_ports() -> None:
    spec = ProbeSpec.parse({"exec": {"command": ["true"]}, "failureThreshold": 2, "successThreshold": 2})
    assert spec is not None and spec.kind is ProbeKind.EXEC and spec.period == 10
    ready = ProbeTracker(spec, initial=False)
    assert not ready.record(ProbeResult.SUCCESS) and ready.record(ProbeResult.SUCCESS) and ready.ok
    assert not ready.record(ProbeResult.FAILURE) and ready.record(ProbeResult.FAILURE) and not ready.ok
    assert resolve_port("http", [{"name": "http", "containerPort": 8080}]) == 8080
    assert resolve_port(81, []) == 81
    with pytest.raises(ValueError, match="grpc"):
        ProbeSpec.parse({"grpc": {"port": 1}})


def _pod(name: str, ip: str | None, ready: bool, labels: dict[str, str], **extra: object) -> dict:
    pod = {
        "metadata": {"name": name, "namespace": "default", "uid": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "ports": [{"name": "web", "containerPort": 8000}]}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]},
    }
    if ip:
        pod["status"]["podIP"] = ip
    pod["metadata"].update(extra)
    return pod


def test_endpoints_subsets() -> None:
    service = {
        "metadata": {"name": "s", "namespace": "default"},
        "spec": {"selector": {"app": "a"}, "ports": [{"name": "http", "port": 80, "targetPort": "web"}]},
    }
    pods = [
        _pod("p1", "127.1.0.5", True, {"app": "a"}),
        _pod("p2", "127.1.0.4", False, {"app": "a"}),
        _pod("p3", None, True, {"app": "a"}),
        _pod("p4", "127.1.0.6", True, {"app": "b"}),
        _pod("p5", "127.1.0.7", True, {"app": "a"}, deletionTimestamp="2026-01-01T00:00:00Z"),
    ]
    (subset,) = compute_subsets(service, pods)
    assert [a["ip"] for a in subset["addresses"]] == ["127.1.0.5"]
    assert [a["ip"] for a in subset["notReadyAddresses"]] == ["127.1.0.4"]
    assert subset["ports"] == [{"name": "http", "port": 8000, "protocol": "TCP"}]
    assert ready_backends({"subsets": [subset]}, "http") == [("127.1.0.5", 8000)]
    assert (
        compute_subsets({**service, "spec": {**service["spec"], "publishNotReadyAddresses": True}}, pods)[0][
            "addresses"
        ][0]["ip"]
        == "127.1.0.4"
    )


def test_service_listeners() -> None:
    svc = {"spec": {"clusterIP": "127.2.0.5", "ports": [{"port": 80}, {"port": 53, "protocol": "UDP"}]}}
    assert service_listeners(svc) == {("127.2.0.5", 80): ""}
    assert service_listeners({"spec": {"clusterIP": "None", "ports": [{"port": 80}]}}) == {}


def test_volumes(tmp_path: Path) -> None:
    shared = tmp_path / "ckpt"
    pod = {
        "spec": {
            "volumes": [
                {"name": "scratch", "emptyDir": {}},
                {"name": "ckpt", "hostPath": {"path": str(shared), "type": "DirectoryOrCreate"}},
                {"name": "cfg", "configMap": {"name": "cfg"}},
            ]
        }
    }
    vols = prepare_volumes(pod, tmp_path / "pod", {"cfg": {"a.txt": "A"}}, {})
    assert shared.is_dir() and (vols["scratch"]).is_dir() and (vols["cfg"] / "a.txt").read_text() == "A"
    container = {
        "name": "c",
        "volumeMounts": [
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "ckpt", "mountPath": str(shared)},
        ],
    }
    env = mount_env(pod, container, vols)
    assert env[volume_env_name("scratch")] == str(vols["scratch"])
    assert env["KELASTIC_VOLUME_CKPT"] == str(shared)
    with pytest.raises(ContainerConfigError, match="set mountPath to the hostPath path"):
        mount_env(pod, {"name": "c", "volumeMounts": [{"name": "ckpt", "mountPath": "/elsewhere"}]}, vols)
    with pytest.raises(ContainerConfigError, match="not supported"):
        prepare_volumes({"spec": {"volumes": [{"name": "x", "nfs": {}}]}}, tmp_path, {}, {})


def test_volume_files_get_the_modes_the_pod_asks_for(tmp_path: Path) -> None:
    secret = {"key": base64.b64encode(b"s3cret").decode(), "other": base64.b64encode(b"x").decode()}
    pod = {
        "spec": {
            "volumes": [
                {
                    "name": "job",
                    "projected": {
                        "defaultMode": 0o400,
                        "sources": [
                            {"secret": {"name": "s", "items": [{"key": "key", "path": "key"}]}},
                            {
                                "configMap": {
                                    "name": "cfg",
                                    "items": [{"key": "a", "path": "a", "mode": 0o440}],
                                }
                            },
                        ],
                    },
                },
                {"name": "plain", "secret": {"secretName": "s", "defaultMode": 0o440}},
                {"name": "cfg", "configMap": {"name": "cfg"}},
            ]
        }
    }
    vols = prepare_volumes(pod, tmp_path / "pod", {"cfg": {"a": "A"}}, {"s": secret})

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert (vols["job"] / "key").read_bytes() == b"s3cret" and not (vols["job"] / "other").exists()
    assert (mode(vols["job"] / "key"), mode(vols["job"] / "a")) == (0o400, 0o440)
    assert (mode(vols["plain"] / "key"), mode(vols["plain"] / "other")) == (0o440, 0o440)
    assert mode(vols["cfg"] / "a") == 0o644  # neither says: Kubernetes' default
    # prepared again (a kubelet restarted over the same pod directory): a read-only file is replaced
    again = prepare_volumes(pod, tmp_path / "pod", {"cfg": {"a": "B"}}, {"s": secret})
    assert (again["job"] / "a").read_text() == "B" and mode(again["job"] / "key") == 0o400


def test_clusters_on_one_machine_claim_distinct_networks(tmp_path: Path) -> None:
    first = claim_networks(tmp_path)
    second = claim_networks(tmp_path)
    try:
        assert (first.index, second.index) == (0, 1)
        assert str(first.pod_network) == "127.1.0.0/21" and str(second.pod_network) == "127.1.8.0/21"
        assert str(second.service_network) == "127.2.8.0/21"
        first.release()
        third = claim_networks(tmp_path)  # a released block is free again
        assert third.index == 0
        third.release()
    finally:
        first.release()
        second.release()
