"""The pod template is judged by the API server before pods exist: a typo is an InvalidSpec naming the field."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.operator.builders import BuildConfig, worker_pod
from kelastic.operator.kube import ApiError, Kube, load_configuration
from kelastic.operator.reconcile import ReconcileConfig, reconcile
from kelastic.operator.spec import parse_job
from kelastic.operator.validation import (
    Passed,
    TemplateChecker,
    dropped_fields,
    manifest_key,
    pod_error,
    stand_in,
)


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


class DryRuns:
    """A dry-run create that records what it judged: refuses pods whose container has ``resource``."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, namespace: str, plural: str, manifest: Mapping[str, Any]) -> Mapping[str, Any]:
        self.names.append(manifest["metadata"]["name"])
        if any("resource" in c for c in manifest["spec"]["containers"]):
            raise ApiError(
                400, "BadRequest", 'strict decoding error: unknown field "spec.containers[0].resource"'
            )
        return manifest


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _checker(dry_runs: DryRuns, clock: Callable[[], float] = time.monotonic) -> TemplateChecker:
    return TemplateChecker(dry_runs, _inline, BuildConfig(), passed=Passed(ttl=600.0, clock=clock))


def test_a_template_is_judged_once_per_generation_not_once_per_pass(kit: SimpleNamespace) -> None:
    dry_runs = DryRuns()
    checker = _checker(dry_runs)
    body = kit.job_body("sweep-001")
    for _ in range(3):  # three reconcile passes of one generation
        assert asyncio.run(checker.check(parse_job(body))).spec is not None
    assert dry_runs.names == ["sweep-001-template-check"]
    body["metadata"]["generation"] = 2
    body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"] = "kelastic:v2"
    asyncio.run(checker.check(parse_job(body)))
    assert dry_runs.names == ["sweep-001-template-check"] * 2 and checker.dry_runs == 2


def test_jobs_made_from_one_template_share_one_dry_run(kit: SimpleNamespace) -> None:
    dry_runs = DryRuns()
    checker = _checker(dry_runs)
    for i in range(50):  # a sweep: the same template under 50 names of one shape
        assert asyncio.run(checker.check(parse_job(kit.job_body(f"sweep-{i:03d}")))).spec is not None
    assert dry_runs.names == ["sweep-000-template-check"]
    # Another shape of name (longer), another template, another namespace: each is judged.
    asyncio.run(checker.check(parse_job(kit.job_body("sweep-longer-name"))))
    asyncio.run(checker.check(parse_job(kit.job_body("sweep-100", command=["python", "other.py"]))))
    other_ns = kit.job_body("sweep-101")
    other_ns["metadata"]["namespace"] = "team-b"
    asyncio.run(checker.check(parse_job(other_ns)))
    assert dry_runs.names[1:] == [
        "sweep-longer-name-template-check",
        "sweep-100-template-check",
        "sweep-101-template-check",
    ]


def test_a_refused_template_is_judged_per_job_and_a_pass_expires(kit: SimpleNamespace) -> None:
    dry_runs = DryRuns()
    now = [0.0]
    checker = _checker(dry_runs, clock=lambda: now[0])
    for name in ("typo-1", "typo-2"):
        job = asyncio.run(checker.check(_typo_job_named(kit, name)))
        assert job.spec is None and job.error is not None
        assert job.error.field == "spec.replicaSpecs.Worker.template.spec.containers[0].resource"
    assert dry_runs.names == ["typo-1-template-check", "typo-2-template-check"]
    asyncio.run(checker.check(parse_job(kit.job_body("good-1"))))
    asyncio.run(checker.check(parse_job(kit.job_body("good-2"))))
    assert dry_runs.names[2:] == ["good-1-template-check"]
    now[0] = 601.0  # an admission policy may have changed since: judge again
    asyncio.run(checker.check(parse_job(kit.job_body("good-3"))))
    assert dry_runs.names[3:] == ["good-3-template-check"]


def test_the_stand_in_keeps_the_shape_of_the_name_and_uid(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body("sweep-a.12"))
    other = parse_job(kit.job_body("train-b.97"))
    assert stand_in(job).meta.name == "aaaaa-a.00" == stand_in(other).meta.name
    assert stand_in(job).meta.uid == "000-00000-0.00"  # uid-sweep-a.12: alphanumerics as 0
    build = BuildConfig()
    pod = worker_pod(stand_in(job), 0, endpoint="127.0.0.1:1", config=build)
    assert manifest_key(pod) == manifest_key(
        worker_pod(stand_in(other), 0, endpoint="127.0.0.1:1", config=build)
    )


def _typo_job_named(kit: SimpleNamespace, name: str) -> Any:
    body = kit.job_body(name)
    main = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    main["resource"] = {"limits": {"cpu": "1"}}
    return parse_job(body)


def test_jobs_applied_together_wait_for_one_dry_run(kit: SimpleNamespace) -> None:
    dry_runs = DryRuns()

    async def slow(fn: Callable[..., Any], *args: Any) -> Any:
        await asyncio.sleep(0.05)  # the dry run is in flight while the other passes start
        return fn(*args)

    checker = TemplateChecker(dry_runs, slow, BuildConfig())

    async def together() -> list[Any]:
        return await asyncio.gather(
            *(checker.check(parse_job(kit.job_body(f"batch-{i:02d}"))) for i in range(20))
        )

    jobs = asyncio.run(together())
    assert all(j.spec is not None for j in jobs) and dry_runs.names == ["batch-00-template-check"]
