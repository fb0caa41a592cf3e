"""Table tests of reconcile's replica-range policy: replicas outside [minReplicas, maxReplicas] run
at the bound (operator/reconcile/replica_range.py).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

from kelastic.operator.reconcile import Emit

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_started_job_scaled_out_of_range_runs_at_the_bound(kit: SimpleNamespace) -> None:
    body = kit.job_body(replicas=9, status={"phase": "Running", "scaledTo": 3})
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3))))
    assert d.status["phase"] == "Scaling"
    assert harness.created_names(d) == ["demo-worker-3"]  # clamped to maxReplicas=4
    c = harness.cond(d, "ReplicasOutOfRange")
    assert c["status"] == "True" and "spec.replicaSpecs.Worker.replicas=9" in c["message"]
    assert [e.reason for e in harness.kinds(d, Emit)] == ["ReplicasOutOfRange", "Scaling"]
    body["status"] = d.status
    assert "ReplicasOutOfRange" not in [
        e.reason for e in harness.kinds(harness.run(body, kit.observed(kit.store())), Emit)
    ]
    body["spec"]["replicaSpecs"]["Worker"]["replicas"] = 4
    back = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(4))))
    assert harness.cond(back, "ReplicasOutOfRange")["status"] == "False"
