"""End-to-end: invalid ElasticJobs are refused by the API server or marked Invalid, naming the field.

Scenario (e) of the operator issue. See conftest.py for the cluster these run on.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("case", "change", "field"),
    [
        ("no-template", lambda m: m["spec"]["replicaSpecs"]["Worker"].pop("template"), "template"),
        ("negative-replicas", lambda m: m["spec"]["replicaSpecs"]["Worker"].update(replicas=-1), "replicas"),
        ("zero-min", lambda m: m["spec"].update(minReplicas=0), "minReplicas"),
        (
            "bad-policy",
            lambda m: m["spec"]["replicaSpecs"]["Worker"].update(restartPolicy="Sometimes"),
            "restartPolicy",
        ),
        # The CRD's cross-field rules, in the operator's words.
        (
            "max-below-min",
            lambda m: m["spec"].update(minReplicas=3, maxReplicas=2),
            "spec.maxReplicas: Invalid",
        ),
        (
            "replicas-above-max",
            lambda m: m["spec"]["replicaSpecs"]["Worker"].update(replicas=5),
            "must be within [spec.minReplicas, spec.maxReplicas] = [2, 4]",
        ),
    ],
)
def test_e_schema_rejects_invalid_manifests_naming_the_field(
    kel: Any, case: str, change: Any, field: str
) -> None:
    manifest = kel.job_manifest(f"e2e-e-{case}")
    change(manifest)
    result = kel.kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump(manifest), check=False)
    assert result.returncode != 0, f"kubectl accepted an invalid ElasticJob ({case})"
    assert field in result.stderr, result.stderr
    assert kel.job(f"e2e-e-{case}") is None


def test_e_kubectl_scale_beyond_max_replicas_is_refused_with_the_same_words(kel: Any) -> None:
    manifest = kel.job_manifest(
        "e2e-e-scale", replicas=2, min_replicas=1, max_replicas=2, spec={"suspend": True}
    )
    kel.apply_job(manifest)
    result = kel.kubectl.run("scale", "ej", "e2e-e-scale", "--replicas", "6", check=False)
    assert result.returncode != 0, "kubectl scale beyond maxReplicas was accepted"
    assert "(6) must be within [spec.minReplicas, spec.maxReplicas] = [1, 2]" in result.stderr, result.stderr
    job = kel.job("e2e-e-scale")
    assert job is not None and job["spec"]["replicaSpecs"]["Worker"]["replicas"] == 2


def test_e_operator_marks_a_command_it_cannot_launch_invalid_naming_the_field(kel: Any) -> None:
    """What the CRD cannot read (the free-form pod template) the operator judges."""
    manifest = kel.job_manifest("e2e-e-cmd", command=["python", "-c", "print(1)"])
    kel.apply_job(manifest)

    def invalid() -> dict[str, Any] | None:
        status = kel.status("e2e-e-cmd")
        for condition in status.get("conditions") or []:
            if condition.get("status") == "True" and "python -c" in (condition.get("message") or ""):
                return condition
        raise kel.LastSeen(status)

    condition = kel.wait_for("an Invalid condition naming the command on elasticjob/e2e-e-cmd", invalid, 60)
    assert "Invalid" in (condition.get("reason", "") + condition.get("type", "")), condition
    assert "containers[0].command" in condition["message"], condition
    assert kel.status("e2e-e-cmd").get("phase") == "Failed"
    assert kel.pods("e2e-e-cmd") == [], "an invalid job must not start pods"
    assert any("python -c" in (e.get("message") or "") for e in kel.job_events("e2e-e-cmd"))
