"""Installing the kelastic Helm chart into a cluster, as a user would, with the real Helm library.

``kelastic local --control-plane DIR`` runs the operator the way a real cluster
does: the chart's Deployment → ReplicaSet → Pod, under the chart's
ServiceAccount and RBAC. :func:`install_chart` does the install with
helm-python-sdk's install action (the same code as ``helm install``):

- the release namespace and every watched namespace are created first (the
  chart puts a Role and RoleBinding in each watched namespace);
- namespaced by default (``watchNamespaces``), cluster-wide with
  ``cluster_wide=True`` (``clusterWide=true``: a ClusterRole);
- an existing release of the same name is upgraded, so a second ``kelastic
  local up`` on the same state is not an error;
- should Helm's install action fail to reach the cluster, the chart is rendered
  with the same library and its objects are created in dependency order (CRDs,
  then ServiceAccount, RBAC, the Deployment) through the Kubernetes client;
- with ``wait`` it waits until the operator's Deployment has an available
  replica, printing progress, and fails naming the operator pod's state.

The chart's image needs no registry here: the process kubelet runs a
container's ``command`` (``kelastic-operator``) as this environment's console
script. The operator pod finds the API server in-cluster: the kubelet hands it
the service-account token (as a kubeconfig in ``KUBECONFIG``) and
``KUBERNETES_SERVICE_HOST``/``PORT``.

This module uses Helm and the Kubernetes client only; it imports nothing of the
operator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .helmlines import helm_lines

__all__ = ["ChartError", "ChartRelease", "install_chart", "render_chart", "uninstall_chart"]

#: The order in which rendered objects are created (what others refer to goes first).
KIND_ORDER = (
    "CustomResourceDefinition",
    "Namespace",
    "NetworkPolicy",  # before the pod it guards
    "ServiceAccount",
    "ClusterRole",
    "Role",
    "ClusterRoleBinding",
    "RoleBinding",
    "Service",
    "Deployment",
)


class ChartError(RuntimeError):
    """The chart could not be installed, uninstalled, or its operator did not come up."""


@dataclass
class ChartRelease:
    """An installed release: where it lives and what it made."""

    name: str
    namespace: str
    #: Namespaces whose ElasticJobs the operator reconciles; empty when cluster-wide.
    watch_namespaces: tuple[str, ...]
    cluster_wide: bool
    kubeconfig: Path
    #: ``"helm"`` (Helm's install action) or ``"applied"`` (rendered, then created object by object).
    method: str
    #: Rendered objects in creation order (CRDs included).
    objects: list[dict[str, Any]] = field(default_factory=list)

    @property
    def deployment(self) -> str:
        """The operator Deployment's name."""
        for obj in self.objects:
            if obj.get("kind") == "Deployment":
                return str(obj["metadata"]["name"])
        raise ChartError(f"release {self.name} has no Deployment")


def render_chart(
    chart_dir: Path | str, release: str, namespace: str, values: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The chart's objects for ``values`` (CRDs first, then templates in :data:`KIND_ORDER`)."""
    import helm_python as helm

    helm.disable_logging()
    with helm.Chart.load(Path(chart_dir)) as chart:
        rendered = chart.render(dict(values or {}), name=release, namespace=namespace, is_install=True)
        crds = [doc for crd in chart.crds for doc in yaml.safe_load_all(crd["data"]) if doc]
    objects = [
        doc
        for path in sorted(rendered)
        if path.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(rendered[path])
        if doc
    ]
    return crds + sorted(objects, key=_creation_rank)


def _creation_rank(obj: Mapping[str, Any]) -> int:
    kind = str(obj.get("kind"))
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def chart_values(
    values: Mapping[str, Any] | None, watch_namespaces: Sequence[str], cluster_wide: bool
) -> dict[str, Any]:
    """The user's values with the scope set (``clusterWide``, ``watchNamespaces``)."""
    out = dict(values or {})
    out["clusterWide"] = cluster_wide
    if not cluster_wide and watch_namespaces:
        out["watchNamespaces"] = list(dict.fromkeys(watch_namespaces))
    return out


def install_chart(
    kubeconfig: Path | str,
    chart_dir: Path | str,
    namespace: str = "kelastic-system",
    values: Mapping[str, Any] | None = None,
    *,
    release: str = "kelastic",
    watch_namespaces: Sequence[str] = (),
    cluster_wide: bool = False,
    wait: float | None = 120.0,
    progress: Callable[[str], None] = print,
) -> ChartRelease:
    """Install (or upgrade) ``chart_dir`` as ``release`` in ``namespace``; see the module docstring.

    ``watch_namespaces`` are the namespaces the operator serves when not
    ``cluster_wide`` (empty: the release namespace). ``wait`` is how long to wait
    for the operator to be available (None: do not wait). Raises
    :class:`ChartError` with what failed and what to do.
    """
    import helm_python as helm

    kubeconfig = Path(kubeconfig)
    watched = () if cluster_wide else tuple(dict.fromkeys(watch_namespaces or (namespace,)))
    final_values = chart_values(values, watched, cluster_wide)
    scope = "all namespaces" if cluster_wide else ", ".join(watched)
    started = time.monotonic()
    api = _Api(kubeconfig)
    try:
        for ns in dict.fromkeys((namespace, *watched)):
            api.ensure_namespace(ns)
        with helm_lines(progress):
            objects = render_chart(chart_dir, release, namespace, final_values)
        helm.disable_logging()
        method = "helm"
        try:
            with (
                helm_lines(progress),
                helm.Config(kubeconfig_path=str(kubeconfig), namespace=namespace) as cfg,
            ):
                existing = {r.get("name") for r in cfg.list()}
                if release in existing:
                    cfg.upgrade(str(chart_dir), release, final_values, namespace=namespace, timeout=60)
                else:
                    cfg.install(str(chart_dir), release, final_values, namespace=namespace, timeout=60)
        except helm.HelmKubeError as exc:
            progress(f"helm could not reach the cluster ({exc}); creating the rendered chart instead")
            method = "applied"
            api.create_all(objects, namespace)
        except helm.HelmError as exc:
            raise ChartError(
                f"helm install of {chart_dir} as release {release!r} in namespace {namespace!r} failed: {exc}"
            ) from exc
        result = ChartRelease(release, namespace, watched, cluster_wide, kubeconfig, method, objects)
        progress(
            f"chart {Path(chart_dir).name} installed as release {release!r} in {namespace} "
            f"({'helm install' if method == 'helm' else 'rendered and applied'}, operator watching {scope}) "
            f"after {time.monotonic() - started:.1f} s"
        )
        if wait is not None:
            api.wait_available(namespace, result.deployment, release, wait, progress)
        return result
    finally:
        api.close()


def uninstall_chart(chart: ChartRelease, *, progress: Callable[[str], None] = print) -> None:
    """Remove what :func:`install_chart` made (CRDs stay, as with ``helm uninstall``)."""
    import helm_python as helm

    api = _Api(chart.kubeconfig)
    try:
        if chart.method == "helm":
            try:
                with helm.Config(kubeconfig_path=str(chart.kubeconfig), namespace=chart.namespace) as cfg:
                    cfg.uninstall(chart.name, ignore_not_found=True, timeout=60)
                progress(f"release {chart.name!r} uninstalled from {chart.namespace}")
                return
            except helm.HelmError as exc:
                # Helm deletes the objects first, then its release record: finish the job.
                progress(f"helm uninstall of {chart.name!r} reported: {exc}; deleting what remains")
                api.delete_release_records(chart.namespace, chart.name)
        api.delete_all([o for o in chart.objects if o.get("kind") != "CustomResourceDefinition"])
        progress(f"release {chart.name!r} removed from {chart.namespace}")
    finally:
        api.close()


class _Api:
    """The few calls around Helm: namespaces, the fallback create/delete, the Deployment's state."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import config, dynamic

        try:
            self._client = config.new_client_from_config(config_file=str(kubeconfig))
        except Exception as exc:
            raise ChartError(f"cannot load the kubeconfig {kubeconfig}: {exc}") from exc
        self._dynamic = dynamic.DynamicClient(self._client)

    def close(self) -> None:
        self._client.close()

    def _resource(self, api_version: str, kind: str) -> Any:
        return self._dynamic.resources.get(api_version=api_version, kind=kind)

    def ensure_namespace(self, name: str) -> None:
        from kubernetes.dynamic.exceptions import ConflictError

        try:
            self._resource("v1", "Namespace").create(
                body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
            )
        except ConflictError:
            pass

    def create_all(self, objects: Iterable[Mapping[str, Any]], namespace: str) -> None:
        from kubernetes.dynamic.exceptions import ConflictError

        for obj in objects:
            resource = self._resource(str(obj["apiVersion"]), str(obj["kind"]))
            ns = (obj.get("metadata") or {}).get("namespace") or namespace
            try:
                resource.create(body=dict(obj), namespace=ns if resource.namespaced else None)
            except ConflictError:
                name = obj["metadata"]["name"]
                current = resource.get(name=name, namespace=ns if resource.namespaced else None)
                body = {
                    **obj,
                    "metadata": {**obj["metadata"], "resourceVersion": current.metadata.resourceVersion},
                }
                resource.replace(body=body, namespace=ns if resource.namespaced else None)
            if obj.get("kind") == "CustomResourceDefinition":
                self._dynamic.resources.invalidate_cache()

    def delete_all(self, objects: Sequence[Mapping[str, Any]]) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        for obj in reversed(objects):
            resource = self._resource(str(obj["apiVersion"]), str(obj["kind"]))
            meta = obj.get("metadata") or {}
            try:
                resource.delete(
                    name=meta["name"], namespace=meta.get("namespace") if resource.namespaced else None
                )
            except NotFoundError:
                pass

    def delete_release_records(self, namespace: str, release: str) -> None:
        """Helm's release Secrets (``owner=helm,name=<release>``)."""
        secrets = self._resource("v1", "Secret")
        for item in secrets.get(namespace=namespace, label_selector=f"owner=helm,name={release}").items:
            secrets.delete(name=item.metadata.name, namespace=namespace)

    def wait_available(
        self, namespace: str, name: str, release: str, timeout: float, progress: Callable[[str], None]
    ) -> None:
        deployments = self._resource("apps/v1", "Deployment")
        started = time.monotonic()
        reported = started
        while True:
            status = deployments.get(name=name, namespace=namespace).to_dict().get("status") or {}
            if int(status.get("availableReplicas") or 0) >= 1:
                progress(f"operator deployment/{name} available after {time.monotonic() - started:.1f} s")
                return
            now = time.monotonic()
            if now - started >= timeout:
                raise ChartError(
                    f"the operator deployment/{name} in {namespace} had no available replica after "
                    f"{timeout:.0f} s; its pods: {self._pod_states(namespace, release)}. Look at "
                    f"`kubectl -n {namespace} describe deployment/{name}` and `kubectl -n {namespace} logs "
                    f"deployment/{name}`"
                )
            if now - reported >= 5:
                progress(
                    f"waiting for the operator deployment/{name} to be available "
                    f"({now - started:.0f} s; pods: {self._pod_states(namespace, release)})"
                )
                reported = now
            time.sleep(0.25)

    def _pod_states(self, namespace: str, release: str) -> str:
        pods = self._resource("v1", "Pod").get(
            namespace=namespace,
            label_selector=f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator",
        )
        states = []
        for pod in pods.to_dict().get("items") or []:
            status = pod.get("status") or {}
            detail = status.get("phase") or "Unknown"
            for cs in status.get("containerStatuses") or []:
                waiting = (cs.get("state") or {}).get("waiting") or {}
                if waiting.get("reason"):
                    detail += f" ({waiting['reason']}: {waiting.get('message', '')})"
            states.append(f"{pod['metadata']['name']} {detail}")
        return "; ".join(states) or "none yet"
