"""Pure parts of the ``kelastic local`` CLI: log relaying, completion rules, manifests."""

from __future__ import annotations

import io
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from kelastic.localcluster.cli.apply import ManifestError, load_manifests
from kelastic.localcluster.cli.cli import Interrupted, _Stopper, exit_code, log_in_kelastic_voice
from kelastic.localcluster.cli.completion import Outcome, outcome_of, register_rule, waitable
from kelastic.localcluster.cli.logrelay import LogFollower, LogRelay


def _relay(tty: bool, interval: float = 10.0) -> tuple[LogRelay, list[str]]:
    out: list[str] = []
    return LogRelay(write=out.append, tty=tty, interval=interval), out


def test_lines_are_prefixed_and_carriage_returns_collapse() -> None:
    relay, out = _relay(tty=False)
    relay.feed("p", "hello\nwor", now=0)
    relay.feed("p", "ld\n10%\r50%\r100%\n", now=0)
    assert "".join(out) == "[p] hello\n[p] world\n[p] 100%\n"


def test_progress_is_rate_limited_when_not_a_tty() -> None:
    relay, out = _relay(tty=False, interval=10)
    for i in range(100):
        relay.feed("p", f"step {i}\r", now=i * 0.5)  # 50 s of redraws
    relay.feed("p", "done\n", now=51)
    lines = "".join(out).splitlines()
    assert lines[0] == "[p] step 0"
    assert 4 <= len(lines) <= 7 and lines[-1] == "[p] done"


def test_progress_redraws_in_place_on_a_tty() -> None:
    relay, out = _relay(tty=True)
    relay.feed("p", "1/3\r", now=0)
    relay.feed("p", "2/3\r", now=0.1)
    relay.feed("q", "other line\n", now=0.2)
    text = "".join(out)
    assert "\r\x1b[K[p] 1/3" in text and "\r\x1b[K[p] 2/3" in text
    assert text.endswith("[p] 2/3\n[q] other line\n")  # the open bar line is ended first


def test_follower_reads_kubelet_layout(tmp_path: Path) -> None:
    relay, out = _relay(tty=False)
    follower = LogFollower(tmp_path, relay)
    run0 = tmp_path / "pods" / "default_job_u1" / "main" / "0.log"
    run0.parent.mkdir(parents=True)
    run0.write_text("first\n")
    follower.poll(0)
    (run0.parent / "1.log").write_text("second\n")
    other = tmp_path / "pods" / "team_w_u2"
    for c in ("a", "b"):
        (other / c).mkdir(parents=True)
        (other / c / "0.log").write_text(f"from {c}\n")
    follower.poll(1)
    follower.poll(2)  # nothing new: nothing printed twice
    assert "".join(out).splitlines() == [
        "[job] first",
        "[job] --- container restarted (run 1) ---",
        "[job] second",
        "[team/w/a] from a",
        "[team/w/b] from b",
    ]


def test_completion_rules() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "status": {"phase": "Failed", "containerStatuses": []}}
    assert outcome_of(pod)[0] is Outcome.FAILED
    job = {"apiVersion": "x.dev/v1", "kind": "Thing", "status": {"phase": "Running"}}
    assert outcome_of(job)[0] is Outcome.PENDING
    job["status"] = {"conditions": [{"type": "Succeeded", "status": "True", "message": "all done"}]}
    assert outcome_of(job) == (Outcome.SUCCEEDED, "Succeeded: all done")
    job["status"] = {"phase": "Failed", "message": "boom"}
    assert outcome_of(job) == (Outcome.FAILED, "Failed: boom")
    job["status"] = {
        "phase": "Failed",
        "conditions": [{"type": "Failed", "status": "True", "reason": "WorkerFailed", "message": "exit 1"}],
    }
    assert outcome_of(job) == (Outcome.FAILED, "Failed: exit 1")
    job["status"] = {"phase": "Running", "progress": "40/100"}
    assert outcome_of(job) == (Outcome.PENDING, "Running, progress 40/100")
    register_rule("x.dev/v1", "Odd", lambda obj: (Outcome.SUCCEEDED, "custom"))
    assert outcome_of({"apiVersion": "x.dev/v1", "kind": "Odd"}) == (Outcome.SUCCEEDED, "custom")
    assert waitable(job) and not waitable({"kind": "Service"})


def test_manifest_errors_name_the_document(tmp_path: Path) -> None:
    good = tmp_path / "ok.yaml"
    good.write_text(
        "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Pod, metadata: {name: a}}\n---\n"
    )
    assert [o["metadata"]["name"] for o in load_manifests([good])] == ["a"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n---\nkind: Pod\nmetadata: {name: b}\n")
    with pytest.raises(ManifestError, match="document 2 has no apiVersion"):
        load_manifests([bad])
    with pytest.raises(ManifestError, match="cannot read"):
        load_manifests([tmp_path / "missing.yaml"])


def test_control_plane_flags_and_chart_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kelastic.localcluster.cli.cli import build_parser, find_chart_dir

    args = build_parser().parse_args(
        [
            "local",
            "up",
            "--control-plane",
            "/k8s/bin",
            "--cluster-wide",
            "--watch-namespace",
            "a",
            "--watch-namespace",
            "b",
        ]
    )
    assert args.control_plane == Path("/k8s/bin") and args.cluster_wide and args.watch_namespace == ["a", "b"]
    run = build_parser().parse_args(["local", "run", "job.yaml"])
    assert run.control_plane is None and not run.cluster_wide
    chart = tmp_path / "chart"
    chart.mkdir()
    monkeypatch.setenv("KELASTIC_CHART_DIR", str(chart))
    assert find_chart_dir() != chart  # no Chart.yaml: not a chart
    (chart / "Chart.yaml").write_text("name: kelastic\n")
    assert find_chart_dir() == chart


def test_a_signal_during_start_up_breaks_off_the_wait_at_once() -> None:
    stopper = _Stopper()
    with stopper.installed():
        started = time.monotonic()
        with pytest.raises(Interrupted) as caught, stopper.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # a start-up step that would take long
        assert time.monotonic() - started < 10
        assert caught.value.signum == signal.SIGTERM and exit_code(caught.value.signum) == 143
        # Afterwards (the clean-up) a signal only sets the event.
        os.kill(os.getpid(), signal.SIGINT)
        assert stopper.event.wait(5) and stopper.signal == signal.SIGINT
    assert exit_code(signal.SIGINT) == 130


def test_a_swallowed_interruption_still_ends_the_start_up() -> None:
    stopper = _Stopper()
    with stopper.installed():
        with pytest.raises(Interrupted), stopper.interruptible():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
            except BaseException:  # as a __del__ or an over-broad handler would
                pass
        with pytest.raises(Interrupted), stopper.interruptible():  # a signal that came before it
            pass


def test_the_in_process_clusters_warnings_speak_as_kelastic() -> None:
    # Without a handler Python prints a warning bare among the pods' lines.
    out = io.StringIO()
    handler = log_in_kelastic_voice(out)
    try:
        logging.getLogger("kelastic.localcluster.controllers.endpoints").warning("could not update %s", "x")
        logging.getLogger("kelastic.localcluster.kubelet").info("chatter")
    finally:
        logging.getLogger("kelastic").removeHandler(handler)
    assert out.getvalue() == "kelastic: could not update x\n"
