"""The agent's /metrics: the text format (checked by prometheus_client's parser), the figures, a live run."""

from __future__ import annotations

import re
import runpy
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kelastic.agent.events import Event, EventSource, MemorySink
from kelastic.agent.exposition import counter, gauge, histogram, render
from kelastic.agent.health import HealthServer
from kelastic.agent.progress import ProgressReport
from kelastic.agent.rendezvous import control
from kelastic.agent.rendezvous.server import ServerProcess
from kelastic.agent.telemetry import AgentTelemetry, ProgressSample, steps_per_second

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition text, by (name, sorted labels), via prometheus_client's parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_exposition_is_read_back_by_prometheus_client() -> None:
    text = render(
        [
            counter("x_restarts_total", "Restarts.\nSecond line with a \\ backslash.", {(("kind", "a"),): 2}),
            gauge("x_world", "World size.", 4),
            gauge("x_unknown", "Not known yet.", None),
            gauge("x_label", "Escaped label.", {(("who", 'say "hi"\n'),): 1.5}),
            histogram("x_seconds", "Durations.", [0.2, 0.7, 3.0], (0.5, 1.0, 5.0)),
        ]
    )
    samples = parse(text)
    assert samples[("x_restarts_total", (("kind", "a"),))] == 2
    assert samples[("x_world", ())] == 4
    assert samples[("x_label", (("who", 'say "hi"\n'),))] == 1.5
    assert samples[("x_seconds_bucket", (("le", "0.5"),))] == 1
    assert samples[("x_seconds_bucket", (("le", "1.0"),))] == 2
    assert samples[("x_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("x_seconds_count", ())] == 3
    assert samples[("x_seconds_sum", ())] == pytest.approx(3.9)
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types == {
        "x_restarts": "counter",
        "x_world": "gauge",
        "x_unknown": "gauge",
        "x_label": "gauge",
        "x_seconds": "histogram",
    }
    with pytest.raises(ValueError, match="_total"):
        counter("x_restarts", "no suffix", 1)


def test_steps_per_second_restarts_its_window_when_the_step_goes_back() -> None:
    assert steps_per_second([]) is None
    assert steps_per_second([ProgressSample(1.0, 5)]) is None
    assert steps_per_second([ProgressSample(0.0, 0), ProgressSample(2.0, 10)]) == 5.0
    # restarted from a checkpoint at step 4: only the samples after it count
    samples = [
        ProgressSample(0.0, 0),
        ProgressSample(1.0, 10),
        ProgressSample(2.0, 4),
        ProgressSample(4.0, 8),
    ]
    assert steps_per_second(samples) == 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_telemetry_counts_rounds_restarts_recoveries_and_progress() -> None:
    clock = Clock()
    forward = MemorySink()
    t = AgentTelemetry(forward, clock=clock)
    before = parse(t.render())
    assert before[("kelastic_agent_restarts_total", (("kind", "failure"),))] == 0
    assert not any(name == "kelastic_agent_step" for name, _ in before)  # nobody reported: no value
    assert not any(name == "kelastic_agent_seconds_since_progress" for name, _ in before)

    def rdzv(world: int, restarts: int = 0) -> Event:
        return Event(
            "kelastic.agent.rendezvous",
            EventSource.AGENT,
            metadata={"world_size": world, "restart_count": restarts},
        )

    t.metrics.observe("agent", "rendezvous", 0.4)
    t.record(rdzv(3))
    t.sample({0: ProgressReport(10, 100, time=clock.now), 1: ProgressReport(12, 100, time=clock.now)})
    clock.now += 2
    t.sample({0: ProgressReport(20, 100, time=clock.now - 0.5), 1: ProgressReport(21, 100, time=clock.now)})
    clock.now += 1
    # a peer was lost: restart (membership), the next round closes 1.5 s later at world 2
    t.metrics.incr("agent", "membership_restarts")
    t.record(
        Event(
            "kelastic.agent.restart", EventSource.AGENT, metadata={"reason": "rendezvous membership changed"}
        )
    )
    clock.now += 1.5
    t.metrics.observe("agent", "rendezvous", 1.2)
    t.record(rdzv(2))
    # then a failed worker spends a restart
    t.metrics.incr("agent", "restarts")
    t.record(
        Event("kelastic.agent.restart", EventSource.AGENT, metadata={"reason": "workers FAILED; 0/1 left"})
    )
    clock.now += 0.5
    t.record(rdzv(2, restarts=1))
    s = parse(t.render())
    assert s[("kelastic_agent_restarts_total", (("kind", "membership"),))] == 1
    assert s[("kelastic_agent_restarts_total", (("kind", "failure"),))] == 1
    assert s[("kelastic_agent_rendezvous_rounds_total", ())] == 2
    assert s[("kelastic_agent_rendezvous_duration_seconds_sum", ())] == pytest.approx(1.6)
    assert s[("kelastic_agent_recovery_seconds_count", (("cause", "membership"),))] == 1
    assert s[("kelastic_agent_recovery_seconds_sum", (("cause", "membership"),))] == pytest.approx(1.5)
    assert s[("kelastic_agent_recovery_seconds_sum", (("cause", "failure"),))] == pytest.approx(0.5)
    assert s[("kelastic_agent_world_size", ())] == 2
    assert s[("kelastic_agent_restart_count", ())] == 1
    assert s[("kelastic_agent_step", ())] == 20  # the slowest rank
    assert s[("kelastic_agent_steps_per_second", ())] == pytest.approx(5.0)
    assert s[("kelastic_agent_seconds_since_progress", ())] == pytest.approx(3.0)
    assert len(forward.events) == 5  # every event still reaches the wrapped sink
    # only the restart a failure caused is kept with its reason, for the operator to say
    assert t.last_failure() == ("workers FAILED; 0/1 left", clock.now)


def test_health_server_serves_metrics_with_the_text_content_type() -> None:
    t = AgentTelemetry()
    server = HealthServer(0, lambda: True, host="127.0.0.1", metrics=t.render).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert ("kelastic_agent_rendezvous_rounds_total", ()) in parse(r.read().decode())
    finally:
        server.stop()


@pytest.mark.slow
def test_the_agent_stays_importable_without_prometheus_client() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import kelastic.agent.launch, kelastic.agent.telemetry, kelastic.agent.cli\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_recovery_travels_with_the_progress_report(server: ServerProcess, run_id: str) -> None:
    store = control.connect(server.endpoint)
    control.publish_progress(store, run_id, "n0", step=3, total=None, restarts=0, recovery=(2.5, 100.0))
    control.publish_progress(store, run_id, "n1", step=3, total=None, restarts=0)
    n0 = control.read_progress(store, run_id, "n0")
    n1 = control.read_progress(store, run_id, "n1")
    assert n0 is not None and n0.recovery == control.Recovery("n0", 2.5, 100.0)
    assert n1 is not None and n1.recovery is None


# --- a live run: real agents, a real store, real gloo ----------------------------------------


def _health_port(agent: Any) -> int | None:
    m = re.search(r"serving /healthz, /readyz and /metrics on port (\d+)", agent.output())
    return int(m.group(1)) if m else None


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return parse(r.read().decode())


@pytest.mark.slow
def test_metrics_of_a_live_run_show_progress_and_the_recovery_after_a_lost_node(
    tmp_path: Path, server: ServerProcess, run_id: str
) -> None:
    cluster = harness.Cluster(tmp_path, server.endpoint, run_id=run_id)
    try:
        _live_run(cluster)
    finally:
        cluster.close()


def _live_run(cluster: Any) -> None:
    common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "0", "--warm-start"]
    common += ["--health-port", "0"]
    script = ["--until-world", "2", "--steps", "60", "--step-time", "0.1", "--total", "100"]
    agents = [cluster.start(n, common, script) for n in ("a", "b", "c")]
    cluster.wait_for("steps at world 3", lambda: sum(w == 3 for _, w, _, _ in cluster.steps()) > 30, 90)
    port = _health_port(agents[0])
    assert port, agents[0].output()[-2000:]
    s = _scrape(port)
    assert s[("kelastic_agent_world_size", ())] == 3
    assert s[("kelastic_agent_rendezvous_rounds_total", ())] >= 1
    assert s[("kelastic_agent_step", ())] >= 1
    assert 0 <= s[("kelastic_agent_seconds_since_progress", ())] < 5
    assert s[("kelastic_agent_restarts_total", (("kind", "membership"),))] == 0

    agents[2].kill_group(signal.SIGKILL)
    cluster.wait_for("steps at world 2", lambda: sum(w == 2 for _, w, _, _ in cluster.steps()) > 10, 60)
    time.sleep(1.5)  # a few progress samples at world 2, for the step rate
    s = _scrape(port)
    print("agent /metrics after the recovery:", {k: v for k, v in s.items() if "bucket" not in k[0]})
    assert s[("kelastic_agent_world_size", ())] == 2
    assert s[("kelastic_agent_restarts_total", (("kind", "membership"),))] >= 1
    assert s[("kelastic_agent_restarts_total", (("kind", "failure"),))] == 0
    assert s[("kelastic_agent_recovery_seconds_count", (("cause", "membership"),))] >= 1
    assert 0 < s[("kelastic_agent_recovery_seconds_sum", (("cause", "membership"),))] < 30
    assert s[("kelastic_agent_rendezvous_rounds_total", ())] >= 2
    assert 1 < s[("kelastic_agent_steps_per_second", ())] < 20  # one step per ~0.1 s
    assert s[("kelastic_agent_seconds_since_progress", ())] < 5
    # the survivors told the store, where the operator reads it
    status = control.read_status(control.connect(cluster.endpoint), cluster.run_id)
    assert status.recoveries and all(0 < r.seconds < 30 for r in status.recoveries)
    assert {r.node for r in status.recoveries} <= {"a", "b"}
    assert cluster.wait_all(60, agents[:2]) == [0, 0]
