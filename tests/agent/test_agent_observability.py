"""Events, metrics and the health endpoints of the agent."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kelastic.agent.events import Event, EventSource, FileSink, LogSink, MemorySink, record
from kelastic.agent.health import HealthServer
from kelastic.agent.metrics import MemorySink as MetricMemorySink
from kelastic.agent.metrics import Metrics


def test_event_json_round_trip() -> None:
    e = Event(
        "kelastic.agent.restart", EventSource.AGENT, 12.5, {"reason": "x", "n": 2, "ok": True, "none": None}
    )
    assert Event.from_json(e.to_json()) == e
    assert json.loads(e.to_json())["source"] == "AGENT"


def test_file_sink_writes_json_lines(tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "sub" / "events.jsonl")
    for i in range(3):
        record(Event(f"e{i}", EventSource.WORKER, metadata={"i": i}), sink)
    lines = (tmp_path / "sub" / "events.jsonl").read_text().splitlines()
    assert [Event.from_json(line).metadata["i"] for line in lines] == [0, 1, 2]


def test_log_sink_and_failing_sink(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def record(self, event: Event) -> None:
            raise RuntimeError("sink down")

    with caplog.at_level(logging.INFO):
        record(Event("hello", EventSource.AGENT), LogSink(level=logging.INFO))
        record(Event("lost", EventSource.AGENT), Broken())  # must not raise
    assert any('"name": "hello"' in r.getMessage() for r in caplog.records)
    assert any("failed to record lost" in r.getMessage() for r in caplog.records)
    mem = MemorySink()
    record(Event("kept", EventSource.AGENT), mem)
    assert mem.names() == ["kept"]


def test_metrics_counters_gauges_timings() -> None:
    sink = MetricMemorySink()
    m = Metrics(sink)
    m.incr("agent", "restarts")
    m.incr("agent", "restarts", 2)
    m.put("workers.w", "remaining_restarts", 3)
    with pytest.raises(KeyError), m.timer("agent", "rendezvous"):
        raise KeyError("timed even when raising")
    assert m.counters() == {"agent.restarts": 3}
    assert m.gauges() == {"workers.w.remaining_restarts": 3.0}
    assert len(m.timings()["agent.rendezvous"]) == 1
    assert [v.name for v in sink.values] == ["restarts", "restarts", "remaining_restarts", "rendezvous"]


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_endpoints() -> None:
    ready = {"v": False}
    server = HealthServer(0, lambda: ready["v"], host="127.0.0.1", detail=lambda: {"state": "X"}).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert _get(base + "/healthz") == (200, {"status": "alive", "state": "X"})
        assert _get(base + "/readyz")[0] == 503
        ready["v"] = True
        assert _get(base + "/readyz")[0] == 200
        assert _get(base + "/nope")[0] == 404
    finally:
        server.stop()


def test_health_port_in_use_is_a_clear_error() -> None:
    first = HealthServer(0, lambda: True, host="127.0.0.1").start()
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{first.port}"):
            HealthServer(first.port, lambda: True, host="127.0.0.1")
    finally:
        first.stop()
