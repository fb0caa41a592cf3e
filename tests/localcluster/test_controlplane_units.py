"""The real control plane's pure parts and failure paths (no Kubernetes binaries needed)."""

from __future__ import annotations

import base64
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kelastic.localcluster.controlplane.controlplane import (
    ComponentFailed,
    ComponentHelp,
    ControlPlane,
    ControlPlaneBinaries,
    KubeVersion,
    component_flags,
    control_plane_dir,
    write_kubeconfig,
)
from kelastic.localcluster.controlplane.pki import ensure_ca, ensure_leaf
from kelastic.localcluster.kubelet.kubelet import Kubelet, KubeletConfig
from kelastic.localcluster.kubelet.nodestatus import micro_time
from kelastic.localcluster.kubelet.podenv import ContainerConfigError
from kelastic.localcluster.kubelet.volumes import prepare_volumes, token_key


def _exe(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_kube_version_parses_release_strings_and_orders() -> None:
    assert KubeVersion.parse("Kubernetes v1.20.2") == KubeVersion(1, 20, 2)
    assert KubeVersion.parse("v1.31.0-rc.1") == KubeVersion(1, 31, 0)
    assert KubeVersion.parse("1.24") == KubeVersion(1, 24, 0)
    assert KubeVersion(1, 20, 2) < KubeVersion(1, 24) < KubeVersion(1, 31, 1)
    assert str(KubeVersion(1, 20, 2)) == "v1.20.2"
    with pytest.raises(ValueError, match="no Kubernetes version"):
        KubeVersion.parse("etcd Version: unknown")


def test_binaries_are_found_and_missing_ones_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ControlPlaneBinaries.find(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no executable kube-apiserver"):
        ControlPlaneBinaries.find(tmp_path)
    _exe(tmp_path / "kube-apiserver", "exit 0")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="no etcd"):
        ControlPlaneBinaries.find(tmp_path)
    path_dir = tmp_path / "path"
    path_dir.mkdir()
    etcd = _exe(path_dir / "etcd", "exit 0")
    monkeypatch.setenv("PATH", str(path_dir))
    found = ControlPlaneBinaries.find(tmp_path)
    assert found.etcd == etcd  # etcd from PATH when the directory has none
    assert found.controller_manager is None and found.scheduler is None
    _exe(tmp_path / "etcd", "exit 0")
    _exe(tmp_path / "kube-scheduler", "exit 0")
    found = ControlPlaneBinaries.find(tmp_path)
    assert found.etcd == tmp_path / "etcd" and found.scheduler == tmp_path / "kube-scheduler"


def test_directory_comes_from_the_flag_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KELASTIC_CONTROL_PLANE", raising=False)
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    assert control_plane_dir(None) is None
    monkeypatch.setenv("KUBEBUILDER_ASSETS", "/assets")
    assert control_plane_dir(None) == Path("/assets")
    monkeypatch.setenv("KELASTIC_CONTROL_PLANE", "/kelastic")
    assert control_plane_dir(None) == Path("/kelastic")
    assert control_plane_dir("/flag") == Path("/flag")


def test_certificates_carry_the_kubernetes_identity_and_are_reused(tmp_path: Path) -> None:
    ca = ensure_ca(tmp_path, "ca", "test-ca")
    node = ensure_leaf(ca, tmp_path, "node", "system:node:n1", organizations=("system:nodes",), client=True)
    cert = x509.load_pem_x509_certificate(node.cert_pem())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:node:n1"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert stat.S_IMODE(os.stat(node.key).st_mode) == 0o600
    server = ensure_leaf(ca, tmp_path, "server", "api", server=True, hosts=("127.0.0.1", "kubernetes"))
    sans = x509.load_pem_x509_certificate(server.cert_pem()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert [str(ip) for ip in sans.value.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert sans.value.get_values_for_type(x509.DNSName) == ["kubernetes"]
    # A restart on the same state keeps its identity.
    before = node.cert_pem()
    assert ensure_leaf(ca, tmp_path, "node", "system:node:n1", client=True).cert_pem() == before
    issuer = x509.load_pem_x509_certificate(ca.cert_pem())
    cert.verify_directly_issued_by(issuer)


def test_kubeconfig_embeds_ca_and_credentials(tmp_path: Path) -> None:
    ca = ensure_ca(tmp_path, "ca", "test-ca")
    admin = ensure_leaf(ca, tmp_path, "admin", "admin", organizations=("system:masters",), client=True)
    path = write_kubeconfig(tmp_path / "kc", "https://127.0.0.1:6443", ca.cert, "admin", admin)
    config = json.loads(path.read_text())
    user = config["users"][0]["user"]
    assert base64.b64decode(user["client-certificate-data"]) == admin.cert_pem()
    assert base64.b64decode(config["clusters"][0]["cluster"]["certificate-authority-data"]) == ca.cert_pem()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_component_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    bins.mkdir()
    _exe(bins / "kube-apiserver", 'echo "Kubernetes v1.20.2"')
    _exe(bins / "etcd", 'echo "etcd: cannot open the data dir" >&2; exit 3')
    lines: list[str] = []
    plane = ControlPlane(
        ControlPlaneBinaries.find(bins), tmp_path / "state", progress=lines.append, timeout=20
    )
    started = time.monotonic()
    with pytest.raises(ComponentFailed) as failure:
        plane.start()
    assert time.monotonic() - started < 15  # noticed at once, not at the deadline
    message = str(failure.value)
    assert "etcd exited with code 3" in message
    assert "cannot open the data dir" in message and "etcd.log" in message


def test_a_port_taken_before_the_component_binds_it_is_retried_with_new_ports(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    bins.mkdir()
    _exe(bins / "kube-apiserver", 'echo "Kubernetes v1.20.2"')
    tries = tmp_path / "tries"
    # Every start loses its port: the message names the cause, and each attempt picked new ports.
    _exe(
        bins / "etcd",
        f'echo "$@" >> {tries}; echo "listen tcp 127.0.0.1:1: bind: address already in use" >&2; exit 1',
    )
    lines: list[str] = []
    plane = ControlPlane(
        ControlPlaneBinaries.find(bins), tmp_path / "state", progress=lines.append, timeout=20
    )
    with pytest.raises(ComponentFailed, match="address already in use"):
        plane.start()
    attempts = tries.read_text().splitlines()
    assert len(attempts) == 3 and len(set(attempts)) == 3
    assert sum("a port was taken while starting" in line for line in lines) == 2


def test_a_component_that_never_gets_healthy_times_out_naming_the_wait(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    bins.mkdir()
    _exe(bins / "kube-apiserver", 'echo "Kubernetes v1.20.2"')
    pid_file = tmp_path / "etcd.pid"
    _exe(bins / "etcd", f'echo $$ > {pid_file}; echo "etcd: starting"; exec sleep 60')
    plane = ControlPlane(ControlPlaneBinaries.find(bins), tmp_path / "state", progress=print, timeout=1.5)
    with pytest.raises(
        ComponentFailed, match=r"timed out after 2 s waiting for etcd /health(.|\n)*etcd: starting"
    ):
        plane.start()
    with pytest.raises(ProcessLookupError):  # stopped (and reaped) on the way out
        os.kill(int(pid_file.read_text()), 0)


def _projected_pod() -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "team", "uid": "u1"},
        "spec": {
            "volumes": [
                {
                    "name": "kube-api-access",
                    "projected": {
                        "sources": [
                            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                            {
                                "configMap": {
                                    "name": "kube-root-ca.crt",
                                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                }
                            },
                            {
                                "downwardAPI": {
                                    "items": [
                                        {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
                                    ]
                                }
                            },
                        ]
                    },
                }
            ]
        },
    }


def test_projected_service_account_volume_holds_token_ca_and_namespace(tmp_path: Path) -> None:
    pod = _projected_pod()
    tokens = {token_key("kube-api-access", "token"): "tok-123"}
    paths = prepare_volumes(pod, tmp_path, {"kube-root-ca.crt": {"ca.crt": "PEM"}}, {}, tokens)
    volume = paths["kube-api-access"]
    assert (volume / "token").read_text() == "tok-123"
    assert (volume / "ca.crt").read_text() == "PEM"
    assert (volume / "namespace").read_text() == "team"
    with pytest.raises(ContainerConfigError, match="no service-account token"):
        prepare_volumes(pod, tmp_path / "again", {"kube-root-ca.crt": {"ca.crt": "PEM"}}, {}, {})


def test_a_container_mounting_the_token_gets_an_in_cluster_kubeconfig(tmp_path: Path) -> None:
    pod = _projected_pod()
    tokens = {token_key("kube-api-access", "token"): "tok-123"}
    volumes = prepare_volumes(pod, tmp_path, {"kube-root-ca.crt": {"ca.crt": "PEM"}}, {}, tokens)
    container = {
        "name": "c",
        "volumeMounts": [
            {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
        ],
    }
    emulator = Kubelet.__new__(Kubelet)
    emulator.config = KubeletConfig(data_dir=tmp_path)
    assert (
        emulator.in_cluster_env(pod, container, volumes, tmp_path) == {}
    )  # plain http: nothing to hand over
    real = Kubelet.__new__(Kubelet)
    real.config = KubeletConfig(data_dir=tmp_path, api_url="https://127.0.0.1:6443")
    env = real.in_cluster_env(pod, container, volumes, tmp_path)
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == "6443"
    config = json.loads(Path(env["KUBECONFIG"]).read_text())
    assert config["users"][0]["user"] == {"token": "tok-123"}
    assert config["contexts"][0]["context"]["namespace"] == "team"
    assert base64.b64decode(config["clusters"][0]["cluster"]["certificate-authority-data"]) == b"PEM"
    without_mount = real.in_cluster_env(pod, {"name": "c"}, volumes, tmp_path)
    assert "KUBECONFIG" not in without_mount and without_mount["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"


def test_lease_renew_time_is_a_micro_time() -> None:
    assert micro_time(0.25) == "1970-01-01T00:00:00.250000Z"


# The lines of `kube-controller-manager --help` that decide its flags, as two releases print them.
HELP_1_20 = """
      --controllers strings                      A list of controllers to enable. '*' enables all.
                                                 All controllers: attachdetach, bootstrapsigner, daemonset, deployment, endpoint, endpointslice, endpointslicemirroring, garbagecollector
                                                 Disabled-by-default controllers: bootstrapsigner, tokencleaner (default [*])
      --port int     The port on which to serve unsecured, unauthenticated access. (default 10252)
  -v, --v Level      number for the log level verbosity
"""
HELP_1_37 = """
      --controllers strings                                A list of controllers to enable.
                                                           All controllers: bootstrap-signer-controller, deployment-controller, endpoints-controller, endpointslice-controller, endpointslice-mirroring-controller, garbage-collector-controller
                                                           Disabled-by-default controllers: bootstrap-signer-controller (default [*])
      --secure-port int                                    The port on which to serve HTTPS. (default 10257)
"""


def test_component_help_gives_flags_and_controller_names() -> None:
    old, new = ComponentHelp.parse(HELP_1_20), ComponentHelp.parse(HELP_1_37)
    assert {"controllers", "port", "v"} <= old.flags and "port" not in new.flags
    assert "secure-port" in new.flags
    assert old.controller("endpoints-controller", "endpoint") == "endpoint"
    assert new.controller("endpoints-controller", "endpoint") == "endpoints-controller"
    assert new.controller("no-such") is None


@pytest.mark.parametrize(
    ("text", "loopback_slices", "manager", "scheduler"),
    [
        # 1.20.2 takes our pod addresses in EndpointSlices: its slice controller runs.
        (HELP_1_20, True, ["--port=0", "--controllers=*,-endpoint"], ["--port=0"]),
        (HELP_1_20, False, ["--port=0", "--controllers=*,-endpoint,-endpointslice"], ["--port=0"]),
        (HELP_1_37, False, ["--controllers=*,-endpoints-controller,-endpointslice-controller"], []),
    ],
)
def test_component_flags_follow_what_the_binary_and_server_offer(
    text: str, loopback_slices: bool, manager: list[str], scheduler: list[str]
) -> None:
    offered = ComponentHelp.parse(text)
    assert component_flags("kube-controller-manager", offered, loopback_slices=loopback_slices) == manager
    assert component_flags("kube-scheduler", offered, loopback_slices=loopback_slices) == scheduler


# The feature-gate lines of `--help`, as 1.37 prints them (1.20 has no component prefix).
GATES_1_37 = """
      --feature-gates colonSeparatedMultimapStringString   Comma-separated list of component:key=value pairs
                                                           kube:GenericWorkload=true|false (BETA - default=false)
                                                           kube:CompositePodGroup=true|false (ALPHA - default=false)
"""
GATES_OLD = """
      --feature-gates mapStringBool   A set of key=value pairs that describe feature gates for alpha/experimental features. Options are:
                                      APIListChunking=true|false (BETA - default=true)
                                      GenericWorkload=true|false (ALPHA - default=false)
"""


def test_beta_gates_are_turned_on_only_where_the_binary_lists_them_as_beta() -> None:
    offered = ComponentHelp.parse(HELP_1_37 + GATES_1_37)
    assert offered.gates == {"GenericWorkload": "BETA", "CompositePodGroup": "ALPHA"}
    assert component_flags("kube-scheduler", offered, loopback_slices=False) == [
        "--feature-gates=GenericWorkload=true"
    ]
    assert component_flags("kube-apiserver", offered, loopback_slices=False) == [
        "--feature-gates=GenericWorkload=true",
        "--runtime-config=scheduling.k8s.io/v1beta1=true",
    ]
    manager = component_flags("kube-controller-manager", offered, loopback_slices=False)
    assert manager[0] == "--feature-gates=GenericWorkload=true" and manager[1].startswith("--controllers=")
    # Asked for none: every default kept.
    assert component_flags("kube-apiserver", offered, loopback_slices=False, gates={}) == []
    # A release that knows the gate only as alpha (another API version), or not at all: untouched.
    old = ComponentHelp.parse(HELP_1_20 + GATES_OLD)
    assert old.gates == {"APIListChunking": "BETA", "GenericWorkload": "ALPHA"}
    assert component_flags("kube-apiserver", old, loopback_slices=False) == []
    assert component_flags("kube-scheduler", ComponentHelp.parse(HELP_1_20), loopback_slices=False) == [
        "--port=0"
    ]


def test_the_control_plane_lanes_skip_message_says_where_to_get_the_binaries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "root_conftest", Path(__file__).resolve().parents[2] / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    for variable in root.VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(root, "BUILT", tmp_path / "cache")
    path, why = root.find_control_plane_bin()
    assert path is None
    for needed in (
        "make control-plane",
        "dl.k8s.io/release",
        "etcd-io/etcd/releases",
        "setup-envtest",
        "KELASTIC_CONTROL_PLANE",
    ):
        assert needed in why, why
    # A build that did not finish (no marker) is not taken; a finished one is, the newest first.
    for version, done in (("v1.36.3", True), ("v1.37.2", True), ("v1.38.0", False)):
        (tmp_path / "cache" / version / "bin").mkdir(parents=True)
        (tmp_path / "cache" / version / "bin" / "kube-apiserver").write_text("")
        if done:
            (tmp_path / "cache" / version / "bin" / root.MARKER).write_text(f"kubernetes {version}")
    assert root.find_control_plane_bin() == (tmp_path / "cache" / "v1.37.2" / "bin", "")
