"""Table tests of reconcile's figures every pass writes: what the rendezvous store reports reaches
the status (operator/reconcile/figures.py).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

from kelastic.operator.observed import RendezvousView

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))


def test_rendezvous_figures_reach_status(kit: SimpleNamespace) -> None:
    body = kit.job_body(status={"phase": "Running", "scaledTo": 3, "backoffCount": 1, "restarts": 1})
    rdzv = RendezvousView(world_size=6, restarts=2, members=("a", "b"), step=120, total=500)
    d = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3)), rendezvous=rdzv))
    assert d.status["worldSize"] == 6
    assert d.status["progress"] == "120/500 (24%)"
    assert d.status["restarts"] == 3
    # the store unreachable: the last known figures stay
    body["status"] = d.status
    d2 = harness.run(body, kit.observed(kit.store(), *(kit.worker(i) for i in range(3))))
    assert (
        d2.status["worldSize"] == 6
        and d2.status["progress"] == "120/500 (24%)"
        and d2.status["restarts"] == 3
    )
