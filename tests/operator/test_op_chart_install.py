"""localcluster.chart: the chart installed, upgraded and removed with Helm's own actions.

Against the API server emulator (no RBAC enforced there; tests/operator/test_op_rbac.py
runs the operator under the installed RBAC on a real API server).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kelastic.operator.kube import ApiError, Kube, load_configuration

pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency: pip install -e '.[dev]'")

from kelastic.localcluster.cli.chart import ChartError, install_chart, render_chart, uninstall_chart

CHART = Path(__file__).resolve().parents[2] / "helm" / "kelastic"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[Path, Kube]]:
    from kelastic.localcluster.apiserver.apiserver import ApiServer

    server = ApiServer(data_dir=tmp_path / "data")
    server.start()
    try:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        kube = Kube(load_configuration(str(kubeconfig)))
        yield kubeconfig, kube
        kube.close()
    finally:
        server.stop()


def names(kube: Kube, path: str) -> list[str]:
    try:
        return sorted(i["metadata"]["name"] for i in kube.request("GET", path)["items"])
    except ApiError as err:
        if err.status == 404:
            return []
        raise


def test_render_puts_what_others_refer_to_first() -> None:
    kinds = [o["kind"] for o in render_chart(CHART, "kel", "ops", {"watchNamespaces": ["a"]})]
    assert kinds[0] == "CustomResourceDefinition" and kinds[-1] == "Deployment"
    assert kinds.index("ServiceAccount") < kinds.index("Role") < kinds.index("RoleBinding")


def test_install_upgrade_to_cluster_wide_and_uninstall(api: tuple[Path, Kube]) -> None:
    kubeconfig, kube = api
    lines: list[str] = []
    release = install_chart(
        kubeconfig, CHART, "ops", release="kel", watch_namespaces=["team-a"], wait=None, progress=lines.append
    )
    assert release.method == "helm" and release.watch_namespaces == ("team-a",)
    assert release.deployment == "kel-kelastic"
    assert "operator watching team-a" in lines[-1]
    # Helm's own lines come with a prefix, never bare; its notice that the chart's CRD is a
    # link tells a user nothing and is kept at DEBUG.
    assert not any("found symbolic link" in line for line in lines), lines
    assert not [line for line in lines if line.split(" ", 1)[0] in ("INFO", "WARN", "ERROR")], lines
    assert kube.request("GET", "/api/v1/namespaces/team-a")["metadata"]["name"] == "team-a"
    assert names(kube, "/apis/rbac.authorization.k8s.io/v1/namespaces/team-a/roles") == ["kel-kelastic"]
    assert names(kube, "/apis/apps/v1/namespaces/ops/deployments") == ["kel-kelastic"]
    args = kube.request("GET", "/apis/apps/v1/namespaces/ops/deployments/kel-kelastic")["spec"]["template"][
        "spec"
    ]["containers"][0]["args"]
    assert "--namespace=team-a" in args
    # The operator pod's own NetworkPolicy (networkPolicy.enabled, the default).
    assert names(kube, "/apis/networking.k8s.io/v1/namespaces/ops/networkpolicies") == [
        "kel-kelastic-operator"
    ]
    assert names(kube, "/api/v1/namespaces/ops/secrets") == ["sh.helm.release.v1.kel.v1"]

    # The same release again, cluster-wide: an upgrade (revision 2), the Role replaced by a ClusterRole.
    wide = install_chart(
        kubeconfig, CHART, "ops", release="kel", cluster_wide=True, wait=None, progress=lines.append
    )
    assert wide.cluster_wide and wide.watch_namespaces == ()
    assert names(kube, "/apis/rbac.authorization.k8s.io/v1/namespaces/team-a/roles") == []
    assert "kel-kelastic" in names(kube, "/apis/rbac.authorization.k8s.io/v1/clusterroles")
    assert names(kube, "/api/v1/namespaces/ops/secrets")[-1] == "sh.helm.release.v1.kel.v2"

    uninstall_chart(wide, progress=lines.append)
    assert names(kube, "/apis/apps/v1/namespaces/ops/deployments") == []
    assert "kel-kelastic" not in names(kube, "/apis/rbac.authorization.k8s.io/v1/clusterroles")
    assert names(kube, "/api/v1/namespaces/ops/secrets") == [], "Helm's release records were left behind"
    assert "elasticjobs.kelastic.dev" in names(
        kube, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    ), "CRDs stay, as with helm uninstall"


def test_waiting_for_an_operator_that_never_runs_fails_naming_its_pod(api: tuple[Path, Kube]) -> None:
    kubeconfig, _ = api  # no kubelet: the operator pod stays Pending
    with pytest.raises(
        ChartError, match=r"no available replica after 1 s; its pods: .*kubectl -n ops describe"
    ):
        install_chart(kubeconfig, CHART, "ops", release="kel", wait=1, progress=lambda _: None)


def test_a_bad_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "kubeconfig"
    bad.write_text("not: [a kubeconfig")
    with pytest.raises(ChartError, match="cannot load the kubeconfig"):
        install_chart(bad, CHART, wait=None)


def test_helm_delete_options_sent_as_protobuf_are_understood() -> None:
    """Helm's uninstall sends DeleteOptions as protobuf; the emulator refused them before."""
    from kelastic.localcluster.apiserver.protobuf import MAGIC, decode_object

    def field(num: int, payload: bytes) -> bytes:
        return bytes([num << 3 | 2, len(payload)]) + payload

    def varint(num: int, value: int) -> bytes:
        return bytes([num << 3 | 0, value])

    options = varint(1, 0) + field(2, field(1, b"u-1")) + field(4, b"Background")
    type_meta = field(1, b"v1") + field(2, b"DeleteOptions")
    body: dict[str, Any] = decode_object(MAGIC + field(1, type_meta) + field(2, options))
    assert body == {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "gracePeriodSeconds": 0,
        "preconditions": {"uid": "u-1"},
        "propagationPolicy": "Background",
    }
