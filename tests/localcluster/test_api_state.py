"""API server persistence: ``state_dir`` keeps objects across a clean restart and a crash."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client, config

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.localcluster.testing import wait_for

CRD = {
    "metadata": {"name": "notes.state.kelastic.io"},
    "spec": {
        "group": "state.kelastic.io",
        "scope": "Namespaced",
        "names": {"plural": "notes", "kind": "Note"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "properties": {"text": {"type": "string"}}}
                        },
                    }
                },
            }
        ],
    },
}


def test_state_dir_survives_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = ApiServer(data_dir=tmp_path, state_dir=state)
    first.start()
    first.write_kubeconfig(tmp_path / "kubeconfig")
    core = client.CoreV1Api(config.new_client_from_config(str(tmp_path / "kubeconfig")))
    created = core.create_namespaced_config_map("default", {"metadata": {"name": "kept"}, "data": {"k": "v"}})
    svc = core.create_namespaced_service(
        "default", {"metadata": {"name": "svc"}, "spec": {"ports": [{"port": 80}], "selector": {"a": "b"}}}
    )
    ext = client.ApiextensionsV1Api(core.api_client)
    ext.create_custom_resource_definition(CRD)
    custom = client.CustomObjectsApi(core.api_client)
    custom.create_namespaced_custom_object(
        "state.kelastic.io",
        "v1",
        "default",
        "notes",
        {
            "apiVersion": "state.kelastic.io/v1",
            "kind": "Note",
            "metadata": {"name": "n1"},
            "spec": {"text": "hi"},
        },
    )
    first.stop()
    second = ApiServer(data_dir=tmp_path, state_dir=state)
    second.start()
    try:
        second.write_kubeconfig(tmp_path / "kubeconfig")
        core = client.CoreV1Api(config.new_client_from_config(str(tmp_path / "kubeconfig")))
        kept = core.read_namespaced_config_map("kept", "default")
        assert kept.data == {"k": "v"} and kept.metadata.uid == created.metadata.uid
        assert core.read_namespaced_service("svc", "default").spec.cluster_ip == svc.spec.cluster_ip
        newer = core.create_namespaced_config_map("default", {"metadata": {"name": "newer"}})
        assert int(newer.metadata.resource_version) > int(kept.metadata.resource_version)
        other = core.create_namespaced_service(
            "default", {"metadata": {"name": "svc2"}, "spec": {"ports": [{"port": 80}]}}
        )
        assert other.spec.cluster_ip != svc.spec.cluster_ip and other.spec.cluster_ip.startswith("127.2.")
        # CRDs come back with their resources served.
        note = client.CustomObjectsApi(core.api_client).get_namespaced_custom_object(
            "state.kelastic.io", "v1", "default", "notes", "n1"
        )
        assert note["spec"] == {"text": "hi"}
    finally:
        second.stop()


def _request(url: str, method: str = "GET", body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_state_survives_a_crash(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cmd = [
        sys.executable,
        "-m",
        "kelastic.localcluster.apiserver",
        "--port",
        "0",
        "--data-dir",
        str(tmp_path),
        "--state-dir",
        str(state),
    ]

    def start() -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        return proc, line.rsplit(" ", 1)[1].strip()

    proc, url = start()
    try:
        _request(
            f"{url}/api/v1/namespaces/default/configmaps",
            "POST",
            {"metadata": {"name": "durable"}, "data": {"a": "1"}},
        )
        snapshot = state / "apiserver-state.json"
        wait_for(
            lambda: snapshot.exists() and "durable" in snapshot.read_text(),
            10,
            "the snapshot to include the new object",
        )
    finally:
        proc.kill()  # no clean shutdown: SIGKILL
        proc.wait(10)
    proc, url = start()
    try:
        cm = _request(f"{url}/api/v1/namespaces/default/configmaps/durable")
        assert cm["data"] == {"a": "1"}
        assert _request(f"{url}/api/v1/namespaces/default")["status"]["phase"] == "Active"
    finally:
        proc.terminate()
        proc.wait(10)
