"""The pod template is judged by the API server before pods exist: a typo is an InvalidSpec naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.localcluster.apiserver import ApiServer
from kelastic.operator.builders import BuildConfig, worker_pod
from kelastic.operator.kube import ApiError, Kube, load_configuration
from kelastic.operator.reconcile import ReconcileConfig, reconcile
from kelastic.operator.spec import parse_job
from kelastic.operator.validation import dropped_fields, pod_error


def test_dropped_fields_are_what_an_old_server_pruned() -> None:
    sent = {"spec": {"containers": [{"name": "c", "resource": {}, "image": "x"}], "volumes": []}}
    returned = {"spec": {"containers": [{"name": "c", "image": "x", "imagePullPolicy": "Always"}]}}
    # An empty map or list left out is not a finding (servers may omit them).
    assert dropped_fields(sent, returned) == []
    sent["spec"]["containers"][0]["resource"] = {"limits": {"cpu": "1"}}
    assert dropped_fields(sent, returned) == ["spec.containers[0].resource"]


def _typo_job(kit: SimpleNamespace) -> Any:
    body = kit.job_body()
    body["metadata"]["namespace"] = "default"
    main = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    main["resource"] = {"limits": {"cpu": "1"}}  # meant: resources
    return parse_job(body)


def test_an_old_server_that_prunes_gets_the_same_verdict(kit: SimpleNamespace) -> None:
    job = _typo_job(kit)
    manifest = worker_pod(job, 0, endpoint="127.0.0.1:1", config=BuildConfig())

    def pruning_dry_run() -> dict[str, Any]:  # what a v1.20 API server answers: the field is gone
        pod = {**manifest, "spec": dict(manifest["spec"])}
        pod["spec"]["containers"] = [
            {k: v for k, v in c.items() if k != "resource"} for c in manifest["spec"]["containers"]
        ]
        return pod

    error = pod_error(manifest, pruning_dry_run, ApiError, lambda e: e.status)  # type: ignore[attr-defined]
    assert error is not None
    assert error.field == "spec.replicaSpecs.Worker.template.spec.containers[0].resource"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    data: Path = tmp_path_factory.mktemp("validation")
    server = ApiServer(data_dir=data)
    server.start()
    server.write_kubeconfig(data / "kubeconfig")
    client = Kube(load_configuration(str(data / "kubeconfig")))
    try:
        yield client
    finally:
        client.close()
        server.stop()


def test_strict_dry_run_names_the_misspelled_field_and_the_job_becomes_invalid(
    kit: SimpleNamespace, kube: Kube
) -> None:
    job = _typo_job(kit)
    manifest = worker_pod(job, 0, endpoint="127.0.0.1:1", config=BuildConfig())
    path = kube.core_path("default", "pods")

    def dry_run() -> dict[str, Any]:
        return kube.dry_run_create("default", "pods", manifest)

    error = pod_error(manifest, dry_run, ApiError, lambda e: e.status)  # type: ignore[attr-defined]
    assert error is not None
    assert error.field == "spec.replicaSpecs.Worker.template.spec.containers[0].resource"
    assert "resources, not resource" in error.message
    assert kube.request("GET", path)["items"] == []  # a dry run creates nothing
    decision = reconcile(
        type(job)(meta=job.meta, spec=None, error=error, status={}),
        kit.observed(services=()),
        ReconcileConfig(min_replicas_timeout=60.0, success_grace=10.0),
    )
    (invalid,) = [c for c in decision.status["conditions"] if c["type"] == "Invalid"]
    assert invalid["reason"] == "InvalidSpec" and "containers[0].resource" in invalid["message"]


def test_a_correct_template_passes(kit: SimpleNamespace, kube: Kube) -> None:
    body = kit.job_body()
    body["metadata"]["namespace"] = "default"
    job = parse_job(body)
    manifest = worker_pod(job, 0, endpoint="127.0.0.1:1", config=BuildConfig())
    dry_run = lambda: kube.dry_run_create("default", "pods", manifest)  # noqa: E731
    assert pod_error(manifest, dry_run, ApiError, lambda e: e.status) is None  # type: ignore[attr-defined]
