"""End-to-end: invalid ElasticJobs are rejected by kubectl or marked Invalid, naming the field.

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


@pytest.mark.lanes("emulator")
def test_e_operator_marks_max_below_min_invalid_naming_the_field(kel: Any) -> None:
    manifest = kel.job_manifest("e2e-e-max", min_replicas=3, max_replicas=2, replicas=2)
    kel.apply_job(manifest)

    def invalid() -> dict[str, Any] | None:
        status = kel.status("e2e-e-max")
        for condition in status.get("conditions") or []:
            if condition.get("status") == "True" and "maxReplicas" in (condition.get("message") or ""):
                return condition
        raise kel.LastSeen(status)

    condition = kel.wait_for("an Invalid condition naming maxReplicas on elasticjob/e2e-e-max", invalid, 60)
    assert "Invalid" in (condition.get("reason", "") + condition.get("type", "")), condition
    assert kel.status("e2e-e-max").get("phase") == "Failed"
    assert kel.pods("e2e-e-max") == [], "an invalid job must not start pods"
    assert any("maxReplicas" in (e.get("message") or "") for e in kel.job_events("e2e-e-max"))
