"""ProgressPublisher: the one path by which a node's progress reaches the rendezvous store."""

from __future__ import annotations

from typing import Any

import pytest

from kelastic.agent.progress import NodeProgress
from kelastic.agent.progress_publisher import ProgressPublisher
from kelastic.agent.rendezvous import ServerProcess, control


class FakeStore:
    """Records publications; fails while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.connects = 0
        self.reports: list[dict[str, Any]] = []
        self.now = 100.0

    def connect(self, endpoint: str) -> object:
        self.connects += 1
        if self.down:
            raise ConnectionError(f"{endpoint} unreachable")
        return self

    def publish(self, store: Any, run_id: str, node: str, **report: Any) -> None:
        if self.down:
            raise ConnectionError("store restarting")
        self.reports.append({"run_id": run_id, "node": node, **report})

    def publisher(self) -> ProgressPublisher:
        return ProgressPublisher(
            "h:1",
            "run",
            "node-a",
            period=1.0,
            pause_after_error=5.0,
            connect=self.connect,
            publish=self.publish,
            clock=lambda: self.now,
        )


def progress(step: int, total: int | None = 100) -> NodeProgress:
    return NodeProgress(step=step, total=total, metrics={}, ranks=1)


def test_publishes_and_repeats_the_last_step_until_a_new_attempt_reports() -> None:
    fake = FakeStore()
    pub = fake.publisher()
    assert pub.publish(progress(40), restarts=0, local_world_size=2)
    assert pub.publish(None, restarts=1, local_world_size=2)  # workers restarted, no report yet
    assert [(r["step"], r["total"], r["restarts"]) for r in fake.reports] == [(40, 100, 0), (40, 100, 1)]
    assert fake.reports[0]["node"] == "node-a" and fake.reports[0]["local_world_size"] == 2
    assert fake.connects == 1  # one connection, kept


def test_at_most_once_per_period_on_ticks() -> None:
    fake = FakeStore()
    pub = fake.publisher()
    assert pub.due()
    pub.publish(progress(1), restarts=0, local_world_size=1)
    fake.now += 0.5
    assert not pub.due()
    fake.now += 0.5
    assert pub.due()


def test_an_unreachable_store_pauses_publishing_then_reconnects(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeStore()
    pub = fake.publisher()
    pub.publish(progress(1), restarts=0, local_world_size=1)
    fake.down = True
    assert not pub.publish(progress(2), restarts=0, local_world_size=1)
    assert "could not publish progress to h:1" in caplog.text
    fake.down = False
    fake.now += 4.0
    assert not pub.publish(progress(3), restarts=0, local_world_size=1)  # still paused: no attempt
    assert fake.connects == 1
    fake.now += 1.0
    assert pub.publish(progress(4), restarts=0, local_world_size=1)
    assert fake.connects == 2  # the dropped connection was opened again
    assert [r["step"] for r in fake.reports] == [1, 4]


def test_the_operator_reads_what_it_publishes(server: ServerProcess, run_id: str) -> None:
    pub = ProgressPublisher(server.endpoint, run_id, "node-a")
    assert pub.publish(progress(7, 70), restarts=2, local_world_size=3)
    store = control.connect(server.endpoint, timeout=10)
    report = control.read_progress(store, run_id, "node-a")
    assert report is not None
    assert (report.step, report.total, report.restarts, report.local_world_size) == (7, 70, 2, 3)
    pub.close()
