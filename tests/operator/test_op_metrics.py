"""The operator's Prometheus series: what each report does to them, read back through /metrics."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kelastic.operator.builders import BuildConfig, worker_pod
from kelastic.operator.metrics import RECOVERY_FIELD, OperatorMetrics, count_recoveries, new_recoveries
from kelastic.operator.spec import parse_job


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_recoveries_of_one_round_count_once_with_the_longest_duration() -> None:
    # three members of one round report the same recovery, a second recovery 20 s later
    reports = [("a", 2.0, 100.0), ("b", 2.4, 100.3), ("c", 1.9, 100.1), ("a", 5.0, 120.0)]
    assert new_recoveries(reports, None) == [(2.4, 100.3), (5.0, 120.0)]
    # already counted up to 100.3: a late report of that round is not new, the next one is
    assert new_recoveries(reports, 100.3) == [(5.0, 120.0)]
    assert new_recoveries(reports, 120.0) == []
    assert new_recoveries([], None) == []


def test_a_recovery_counted_is_marked_in_the_status_and_never_counted_again() -> None:
    # The agents keep reporting their latest recovery for as long as they run: an operator
    # that restarts (or a standby that takes over) reads the mark and counts nothing again.
    reports = [("a", 2.0, 1_700_000_100.25), ("b", 2.4, 1_700_000_100.5)]
    status = {"phase": "Running", "worldSize": 2}
    durations, written = count_recoveries(status, reports)
    assert durations == [2.4]
    assert written == {**status, RECOVERY_FIELD: "2023-11-14T22:15:00.500Z"}
    assert count_recoveries(written, reports) == ([], written)  # the next operator, same reports
    later = [*reports, ("a", 7.0, 1_700_000_160.0)]  # the next recovery, a minute later
    durations, again = count_recoveries(written, later)
    assert durations == [7.0] and again[RECOVERY_FIELD] == "2023-11-14T22:16:00.000Z"
    # No mark yet (a job from before the field existed), or no reports: nothing is lost or invented.
    assert count_recoveries({}, []) == ([], {})


@pytest.fixture
def metrics() -> Iterator[OperatorMetrics]:
    m = OperatorMetrics()
    yield m
    m.stop()


def test_series_follow_the_controllers_reports(metrics: OperatorMetrics) -> None:
    port = metrics.serve(0, "127.0.0.1")
    a, b = ("ns", "a"), ("ns", "b")
    metrics.job_observed(a, "Running", world_size=4, restarts=1)
    metrics.job_observed(b, None)
    metrics.reconciled(0.02)
    metrics.reconciled(0.3)
    metrics.action_applied("RecreateWorker")
    metrics.action_applied("RecreateWorker")
    metrics.action_applied("CreateWorker")  # creating a missing worker is not a recreation
    metrics.api_error(409)
    durations, status = count_recoveries({}, [("w0", 3.0, 50.0), ("w1", 3.5, 50.2)])
    assert durations == [3.5]
    metrics.recoveries_counted(durations)
    assert count_recoveries(status, [("w0", 3.0, 50.0), ("w1", 3.5, 50.2)])[0] == []  # same again
    s = scrape(port)
    assert s[("kelastic_jobs", (("phase", "Running"),))] == 1
    assert s[("kelastic_jobs", (("phase", "Created"),))] == 1  # no phase yet
    assert s[("kelastic_jobs", (("phase", "Failed"),))] == 0
    assert s[("kelastic_job_world_size", (("job", "a"), ("namespace", "ns")))] == 4
    assert s[("kelastic_job_restarts", (("job", "a"), ("namespace", "ns")))] == 1
    assert s[("kelastic_reconcile_total", ())] == 2
    assert s[("kelastic_reconcile_duration_seconds_count", ())] == 2
    assert s[("kelastic_reconcile_duration_seconds_sum", ())] == pytest.approx(0.32)
    assert s[("kelastic_pod_recreations_total", (("reason", "RecreateWorker"),))] == 2
    assert ("kelastic_pod_recreations_total", (("reason", "CreateWorker"),)) not in s
    assert s[("kelastic_api_errors_total", (("code", "409"),))] == 1
    assert s[("kelastic_recovery_seconds_count", ())] == 1
    assert s[("kelastic_recovery_seconds_bucket", (("le", "5.0"),))] == 1
    assert s[("kelastic_recovery_seconds_bucket", (("le", "3.0"),))] == 0

    metrics.job_observed(a, "Succeeded", world_size=0, restarts=1)
    metrics.job_removed(b)
    s = scrape(port)
    assert s[("kelastic_jobs", (("phase", "Running"),))] == 0
    assert s[("kelastic_jobs", (("phase", "Succeeded"),))] == 1
    assert s[("kelastic_jobs", (("phase", "Created"),))] == 0
    metrics.job_removed(a)
    s = scrape(port)
    assert not any(name == "kelastic_job_world_size" for name, _ in s)


def test_worker_pods_carry_the_scrape_annotations_of_the_agents_health_port(kit: SimpleNamespace) -> None:
    body = kit.job_body()
    job = parse_job(body)
    pod = worker_pod(job, 0, endpoint="h:1", config=BuildConfig(health_port=8081))
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8081",
        "prometheus.io/path": "/metrics",
    }
    # the template's own annotations win; without a health port there is nothing to scrape
    body["spec"]["replicaSpecs"]["Worker"]["template"]["metadata"] = {
        "annotations": {"prometheus.io/scrape": "false"}
    }
    pod = worker_pod(parse_job(body), 0, endpoint="h:1", config=BuildConfig(health_port=8081))
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "false"
    pod = worker_pod(parse_job(kit.job_body()), 0, endpoint="h:1", config=BuildConfig(health_port=None))
    assert "prometheus.io/scrape" not in (pod["metadata"].get("annotations") or {})


def test_standbys_and_goodput_series_follow_the_status_and_go_with_the_job(metrics: OperatorMetrics) -> None:
    port = metrics.serve(0, "127.0.0.1")
    key = ("ns", "a")
    goodput = {"ratio": 0.934, "elapsedSeconds": 600.0, "productiveSeconds": 560.4, "restartSeconds": 24.0,
               "redoneSeconds": 11.0, "saveStallSeconds": 4.6, "percent": "93.4%"}  # fmt: skip
    metrics.job_observed(key, "Running", world_size=3, restarts=5, standbys=1, goodput=goodput)
    metrics.job_observed(("ns", "plain"), "Running", world_size=3, restarts=0)
    s = scrape(port)
    labels = (("job", "a"), ("namespace", "ns"))
    assert s[("kelastic_job_standbys", labels)] == 1
    assert s[("kelastic_job_goodput_ratio", labels)] == pytest.approx(0.934)
    for kind, value in (("elapsed", 600.0), ("productive", 560.4), ("restart", 24.0), ("redone", 11.0),
                        ("save_stall", 4.6)):  # fmt: skip
        assert (
            s[("kelastic_job_goodput_seconds", (("job", "a"), ("kind", kind), ("namespace", "ns")))] == value
        )
    # A job whose status has neither gets no series.
    assert not any(
        dict(lbl).get("job") == "plain" for name, lbl in s if "goodput" in name or "standbys" in name
    )
    metrics.job_removed(key)
    s = scrape(port)
    assert not any(name.startswith(("kelastic_job_goodput", "kelastic_job_standbys")) for name, _ in s)
