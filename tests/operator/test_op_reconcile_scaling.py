"""Table tests of reconcile's scaling policy: worker pods for indices [0, replicas), those above
deleted (operator/reconcile/scaling.py).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

from kelastic.operator.reconcile import PublishMembership

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_terminating_pod_blocks_its_name_until_gone(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3})
    d = harness.run(
        body, kit.observed(kit.store(), kit.worker(0), kit.worker(1, terminating=True), kit.worker(2))
    )
    assert not harness.created_names(d) and not harness.deleted_names(d)
    assert harness.kinds(d, PublishMembership)[0].nodes == ("demo-worker-0", "demo-worker-2")


@pytest.mark.parametrize(
    ("replicas", "scaled_to", "present", "create", "delete", "phase"),
    [
        (4, 3, [0, 1, 2], ["demo-worker-3"], [], "Scaling"),
        (2, 3, [0, 1, 2], [], ["demo-worker-2"], "Scaling"),
        (2, 4, [0, 1, 2, 3], [], ["demo-worker-3", "demo-worker-2"], "Scaling"),
        (3, 3, [0, 1, 2], [], [], "Running"),
    ],
    ids=["up", "down", "down-two-highest-first", "steady"],
)
def test_scale(
    kit: SimpleNamespace,
    replicas: int,
    scaled_to: int,
    present: list[int],
    create: list[str],
    delete: list[str],
    phase: str,
) -> None:
    body = kit.job_body(replicas=replicas, status={"phase": "Running", "scaledTo": scaled_to})
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in present)))
    assert harness.created_names(d) == create
    assert harness.deleted_names(d) == delete
    assert d.status["phase"] == phase
    # membership never lists a pod that is being scaled away
    assert all(int(n.rsplit("-", 1)[1]) < replicas for n in harness.kinds(d, PublishMembership)[0].nodes)


def test_scale_down_converges_to_running(kit: SimpleNamespace) -> None:
    body = kit.job_body(replicas=2, status={"phase": "Scaling", "scaledTo": 3})
    d = harness.run(body, kit.observed(kit.store(), kit.worker(0), kit.worker(1)))
    assert d.status["phase"] == "Running" and d.status["scaledTo"] == 2
