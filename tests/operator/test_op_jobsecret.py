"""The job's secret: the Secret's manifest, how worker pods mount it, when the reconcile asks for it,
how the executor creates it (its value made there, never in a decision), and the token rule."""

from __future__ import annotations

import asyncio
import base64
import re
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent import contract
from kelastic.operator import jobsecret
from kelastic.operator.builders import BuildConfig, owner_reference, store_pod, worker_pod
from kelastic.operator.executor import ActionExecutor
from kelastic.operator.jobcache import JobCache
from kelastic.operator.kube import ApiError
from kelastic.operator.metrics import OperatorMetrics
from kelastic.operator.observed import PodPhase, pod_view
from kelastic.operator.reconcile import CreatePod, CreateSecret, Decision, reconcile
from kelastic.operator.spec import Job, parse_job
from kelastic.operator.status import CONDITION_INVALID, find_condition

CFG = BuildConfig()
HEX64 = re.compile(r"^[0-9a-f]{64}$")


MASTER = b"m" * 64


def test_a_jobs_secret_is_derived_from_the_master_key_and_its_uid_alone() -> None:
    import hashlib
    import hmac

    value = jobsecret.derived_value(MASTER, "uid-1")
    assert HEX64.match(value)
    assert value == hmac.new(MASTER, b"kelastic job secret" + b"uid-1", hashlib.sha256).hexdigest()
    assert jobsecret.derived_value(MASTER, "uid-1") == value  # the operator recomputes it at any time
    assert jobsecret.derived_value(MASTER, "uid-2") != value
    assert jobsecret.derived_value(b"n" * 64, "uid-1") != value
    with pytest.raises(ValueError, match="uid"):
        jobsecret.derived_value(MASTER, "")


def job_of(kit: SimpleNamespace, **kw: Any) -> Job:
    job = parse_job(kit.job_body(**kw))
    assert job.spec is not None, job.error
    return job


def pod_spec_of(kit: SimpleNamespace, **template_spec: Any) -> dict[str, Any]:
    body = kit.job_body()
    body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"].update(template_spec)
    job = parse_job(body)
    assert job.spec is not None, job.error
    return worker_pod(job, 0, endpoint="h:1", config=CFG)["spec"]


# ------------------------------------------------------------------ the Secret


def test_the_secret_is_the_jobs_own_owned_by_it_and_holds_no_value_until_the_executor_adds_one(
    kit: SimpleNamespace,
) -> None:
    job = job_of(kit)
    manifest = jobsecret.secret_manifest(job, owner_reference(job))
    meta = manifest["metadata"]
    assert (manifest["kind"], manifest["type"], manifest["immutable"]) == ("Secret", "Opaque", True)
    assert (meta["name"], meta["namespace"]) == ("demo-secret-uiddemo", "ns")
    assert meta["labels"] == {contract.LABEL_JOB_NAME: "demo"}
    (owner,) = meta["ownerReferences"]
    assert owner["uid"] == "uid-demo" and owner["controller"] is True and owner["kind"] == "ElasticJob"
    assert "data" not in manifest and "stringData" not in manifest
    value = jobsecret.new_value()
    full = jobsecret.with_value(manifest, value)
    assert base64.b64decode(full["data"][contract.JOB_SECRET_KEY]).decode() == value
    assert "data" not in manifest  # the decision's manifest is left as it was


def test_a_value_is_256_random_bits_as_64_lowercase_hex_digits() -> None:
    values = {jobsecret.new_value() for _ in range(64)}
    assert len(values) == 64 and all(HEX64.match(v) for v in values)
    assert len(bytes.fromhex(next(iter(values)))) * 8 == 256 >= contract.JOB_SECRET_MIN_BYTES * 8


def test_a_later_job_of_the_same_name_gets_another_secret(kit: SimpleNamespace) -> None:
    first = parse_job(kit.job_body())
    body = kit.job_body()
    body["metadata"]["uid"] = "7f3e9a21-0c4b-4e5e-9a1b-2d3c4e5f6a7b"
    second = parse_job(body)
    assert jobsecret.secret_name(first) != jobsecret.secret_name(second) == "demo-secret-7f3e9a21"


# ------------------------------------------------------------------ the worker pod


def test_the_worker_container_alone_mounts_the_secret_read_only_and_its_agent_is_told_the_file(
    kit: SimpleNamespace,
) -> None:
    body = kit.job_body()
    tmpl = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    tmpl["containers"].append({"name": "sidecar", "image": "busybox"})
    tmpl["initContainers"] = [{"name": "setup", "image": "busybox"}]
    job = parse_job(body)
    pod = worker_pod(job, 0, endpoint="h:1", config=CFG)
    spec = pod["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == jobsecret.JOB_SECRET_VOLUME]
    (source,) = volume["projected"]["sources"]
    assert source == {
        "secret": {
            "name": jobsecret.secret_name(job),
            "items": [{"key": contract.JOB_SECRET_KEY, "path": contract.JOB_SECRET_KEY}],
        }
    }
    main, sidecar = spec["containers"]
    assert {
        "name": jobsecret.JOB_SECRET_VOLUME,
        "mountPath": contract.JOB_SECRET_MOUNT_DIR,
        "readOnly": True,
    } in (main["volumeMounts"])
    others = [*spec["initContainers"], sidecar]
    assert not any(
        m["name"] == jobsecret.JOB_SECRET_VOLUME for c in others for m in c.get("volumeMounts") or []
    )
    flag = main["command"].index(contract.FLAG_JOB_SECRET_FILE)
    assert main["command"][flag + 1] == contract.JOB_SECRET_FILE
    # never an environment variable: no env entry refers to the Secret
    assert not any(
        "secretKeyRef" in (e.get("valueFrom") or {}) for c in spec["containers"] for e in c.get("env") or []
    )
    # the store pod has no part of it
    assert "secret" not in str(store_pod(job, config=CFG)["spec"]).lower()


@pytest.mark.parametrize(
    ("pod_context", "own_context", "mode"),
    [
        ({}, {}, 0o444),  # the image's own user, unknown: readable by it whoever it is
        ({"runAsUser": 0}, {}, 0o400),
        ({"runAsUser": 1000}, {"runAsUser": 0}, 0o400),  # the container's own setting wins
        ({"runAsUser": 1000, "fsGroup": 2000}, {}, 0o440),  # the kubelet gives the file the fsGroup
        ({"runAsUser": 0, "fsGroup": 2000}, {"runAsUser": 1000}, 0o440),
        ({"runAsUser": 1000}, {}, 0o444),  # no group given: the file stays root's
    ],
)
def test_the_secret_file_is_readable_by_the_containers_user(
    kit: SimpleNamespace, pod_context: dict[str, Any], own_context: dict[str, Any], mode: int
) -> None:
    body = kit.job_body()
    tmpl = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    tmpl["securityContext"] = pod_context
    tmpl["containers"][0]["securityContext"] = own_context
    spec = worker_pod(parse_job(body), 0, endpoint="h:1", config=CFG)["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == jobsecret.JOB_SECRET_VOLUME]
    assert volume["projected"]["defaultMode"] == mode


def test_a_template_copied_from_a_worker_pod_gets_one_secret_volume(kit: SimpleNamespace) -> None:
    pod = worker_pod(job_of(kit), 0, endpoint="h:1", config=CFG)
    body = kit.job_body()
    tmpl = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    tmpl["volumes"] = pod["spec"]["volumes"]
    tmpl["containers"][0]["volumeMounts"] = pod["spec"]["containers"][0]["volumeMounts"]
    again = worker_pod(parse_job(body), 0, endpoint="h:1", config=CFG)["spec"]
    assert [v["name"] for v in again["volumes"]].count(jobsecret.JOB_SECRET_VOLUME) == 1
    mounts = again["containers"][0]["volumeMounts"]
    assert [m["name"] for m in mounts].count(jobsecret.JOB_SECRET_VOLUME) == 1


@pytest.mark.parametrize(
    ("kind", "path", "field"),
    [
        ("containers", contract.JOB_SECRET_MOUNT_DIR, "containers[0].volumeMounts[0].mountPath"),
        ("containers", contract.JOB_SECRET_MOUNT_DIR + "/", "containers[0].volumeMounts[0].mountPath"),
        ("containers", contract.JOB_SECRET_MOUNT_DIR + "/x", "containers[0].volumeMounts[0].mountPath"),
        ("initContainers", contract.JOB_SECRET_MOUNT_DIR, "initContainers[0].volumeMounts[0].mountPath"),
    ],
)
def test_a_template_that_mounts_another_volume_where_the_secret_goes_is_invalid(
    kit: SimpleNamespace, kind: str, path: str, field: str
) -> None:
    body = kit.job_body()
    tmpl = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    tmpl["volumes"] = [{"name": "creds", "emptyDir": {}}]
    mount = {"name": "creds", "mountPath": path}
    if kind == "containers":
        tmpl["containers"][0]["volumeMounts"] = [mount]
    else:
        tmpl["initContainers"] = [{"name": "setup", "image": "busybox", "volumeMounts": [mount]}]
    job = parse_job(body)
    assert job.spec is None and job.error is not None
    assert job.error.field == f"spec.replicaSpecs.Worker.template.spec.{field}"
    assert "job's secret" in job.error.message and "'creds' elsewhere" in job.error.message
    # the reconcile turns it into the Invalid condition, before anything is created
    decision = reconcile(job, kit.observed(services=()))
    invalid = find_condition(decision.status["conditions"], CONDITION_INVALID)
    assert invalid is not None and invalid["status"] == "True"
    assert contract.JOB_SECRET_MOUNT_DIR in invalid["message"]
    assert not [a for a in decision.actions if isinstance(a, CreatePod | CreateSecret)]


def test_a_mount_above_the_secrets_directory_is_fine(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    tmpl = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    tmpl["volumes"] = [{"name": "run", "emptyDir": {}}]
    tmpl["containers"][0]["volumeMounts"] = [{"name": "run", "mountPath": "/var/run/secrets"}]
    assert parse_job(body).spec is not None


# ------------------------------------------------------------------ the service-account token


def test_worker_pods_mount_no_token_unless_the_template_asks(kit: SimpleNamespace) -> None:
    assert pod_spec_of(kit)["automountServiceAccountToken"] is False
    named = pod_spec_of(kit, serviceAccountName="trainer")
    assert "automountServiceAccountToken" not in named  # the ServiceAccount's own setting holds
    assert pod_spec_of(kit, automountServiceAccountToken=True)["automountServiceAccountToken"] is True
    both = pod_spec_of(kit, serviceAccountName="trainer", automountServiceAccountToken=False)
    assert both["automountServiceAccountToken"] is False
    assert store_pod(job_of(kit), config=CFG)["spec"]["automountServiceAccountToken"] is False


# ------------------------------------------------------------------ when the reconcile asks for it


def secret_actions(decision: Decision) -> list[CreateSecret]:
    return [a for a in decision.actions if isinstance(a, CreateSecret)]


def test_the_first_pass_asks_for_the_secret_with_its_workers_and_without_a_value(
    kit: SimpleNamespace,
) -> None:
    decision = reconcile(job_of(kit), kit.observed(kit.store()))
    assert len([a for a in decision.actions if isinstance(a, CreatePod)]) == 3
    (action,) = secret_actions(decision)
    assert action.manifest["metadata"]["name"] == "demo-secret-uiddemo"
    assert "data" not in action.manifest and "stringData" not in action.manifest


def test_the_secret_is_asked_for_only_by_a_pass_that_creates_workers_while_none_holds_the_key(
    kit: SimpleNamespace,
) -> None:
    job = job_of(kit)
    # the Service has no cluster IP yet: no worker is created, nor the secret
    assert secret_actions(reconcile(job, kit.observed(services=()))) == []
    # a worker pod holds the key, even one that is going: a new Secret would give new pods another key
    holder = kit.worker(1, holds_secret=True)
    assert secret_actions(reconcile(job, kit.observed(kit.store(), holder))) == []
    going = kit.worker(0, PodPhase.FAILED, terminating=True, holds_secret=True)
    assert secret_actions(reconcile(job, kit.observed(kit.store(), going))) == []
    # nothing to create: nothing asked, whoever holds what
    full = [kit.worker(i) for i in range(3)]
    assert secret_actions(reconcile(job, kit.observed(kit.store(), *full))) == []
    # pods without the key (made before the job had a Secret): their replacement gets one
    assert len(secret_actions(reconcile(job, kit.observed(kit.store(), *full[:2])))) == 1
    # every worker gone (a full restart, a resume): asked again; the create keeps an existing Secret (409)
    assert len(secret_actions(reconcile(job, kit.observed(kit.store())))) == 1


def test_a_pod_view_says_whether_the_pod_holds_the_key(kit: SimpleNamespace) -> None:
    job = job_of(kit)
    assert pod_view(worker_pod(job, 0, endpoint="h:1", config=CFG)).holds_secret
    assert not pod_view(store_pod(job, config=CFG)).holds_secret


# ------------------------------------------------------------------ the executor


class SecretKube:
    """Records creates; answers a Secret create with ``secret_status`` (201 when None)."""

    def __init__(self, secret_status: int | None = None) -> None:
        self.secret_status = secret_status
        self.created: list[tuple[str, dict[str, Any]]] = []

    def create(self, namespace: str, plural: str, manifest: dict[str, Any]) -> dict[str, Any]:
        if plural == "secrets" and self.secret_status is not None:
            raise ApiError(
                self.secret_status, "Forbidden" if self.secret_status == 403 else "AlreadyExists", "no"
            )
        self.created.append((plural, manifest))
        return {
            **manifest,
            "metadata": {**manifest["metadata"], "uid": f"uid-{manifest['metadata']['name']}"},
        }


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    def emit(self, body: Any, reason: str, message: str, *, warning: bool = False) -> None:
        self.posted.append((reason, message))


def apply_first_pass(kit: SimpleNamespace, kube: SecretKube) -> tuple[ActionExecutor, Events]:
    job = job_of(kit)
    decision = reconcile(job, kit.observed())  # no store yet: the store pod and the workers, with the secret
    events = Events()

    async def io(fn: Any, *args: Any) -> Any:
        return fn(*args)

    executor = ActionExecutor(
        kube,  # type: ignore[arg-type]
        io,
        events,  # type: ignore[arg-type]
        OperatorMetrics(),
        JobCache(),
        lambda key, action: None,
        lambda uid: jobsecret.derived_value(MASTER, uid),
    )
    body = kit.job_body()
    asyncio.run(executor.apply(job, body, decision, [], []))
    return executor, events


def test_the_executor_makes_the_value_and_creates_the_secret_before_the_workers(kit: SimpleNamespace) -> None:
    kube = SecretKube()
    executor, events = apply_first_pass(kit, kube)
    plurals = [p for p, _ in kube.created]
    assert plurals[0] == "secrets" and plurals.count("pods") == 4  # the store and 3 workers after it
    secret = kube.created[0][1]
    value = base64.b64decode(secret["data"][contract.JOB_SECRET_KEY]).decode()
    assert HEX64.match(value)
    assert value == jobsecret.derived_value(MASTER, kit.job_body()["metadata"]["uid"])
    assert all(value not in message for _, message in events.posted)
    assert (
        "CreateJobSecret",
        "creating Secret demo-secret-uiddemo: the key of the job's agents",
    ) in events.posted
    assert not executor.failed


def test_a_secret_that_exists_is_kept_and_the_workers_are_created(kit: SimpleNamespace) -> None:
    kube = SecretKube(secret_status=409)
    executor, events = apply_first_pass(kit, kube)
    assert [p for p, _ in kube.created].count("pods") == 4
    assert not executor.failed and not [r for r, _ in events.posted if r == "FailedCreate"]


def test_a_secret_that_cannot_be_created_holds_the_workers_back_and_says_so(kit: SimpleNamespace) -> None:
    kube = SecretKube(secret_status=403)
    executor, events = apply_first_pass(kit, kube)
    pods = [m["metadata"]["name"] for p, m in kube.created if p == "pods"]
    assert pods == ["demo-rendezvous"]  # the store goes on; no worker without its key
    assert executor.failed  # the pass is retried with the job's back-off
    (failure,) = [m for r, m in events.posted if r == "FailedCreate"]
    assert "creating Secret demo-secret-uiddemo" in failure and "worker pods wait for it" in failure
