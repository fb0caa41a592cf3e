"""Helm's own lines carry a prefix (localcluster/cli/helmlines.py), with Helm's real Go code."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kelastic.localcluster.cli.chart import render_chart
from kelastic.localcluster.cli.helmlines import go_log_line, helm_lines

CHART = Path(__file__).resolve().parents[2] / "helm" / "kelastic"


def test_helms_symlink_notice_goes_to_debug_and_not_to_stderr(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    said: list[str] = []
    with (
        caplog.at_level(logging.DEBUG, logger="kelastic.localcluster.cli.helmlines"),
        helm_lines(said.append),
    ):
        objects = render_chart(CHART, "kelastic", "kelastic-system")
    assert objects, "the chart rendered nothing"
    # The chart ships crds/elasticjob.yaml as a link, which Helm's loader reports at INFO:
    # nothing a user can act on, so it is kept at DEBUG rather than said.
    assert "found symbolic link" in caplog.text
    assert not [s for s in said if "found symbolic link" in s], said
    assert all(s.startswith("helm: ") for s in said), said
    assert "found symbolic link" not in capfd.readouterr().err


def test_helms_other_lines_are_said_with_a_prefix() -> None:
    said: list[str] = []
    with helm_lines(said.append):
        os.write(2, b"2026/11/28 15:34:06 INFO something Helm says\n")
    assert said == ["helm: INFO something Helm says"]


def test_other_writes_to_stderr_pass_unchanged_and_a_broken_sink_loses_nothing(
    capfd: pytest.CaptureFixture[str],
) -> None:
    def broken(line: str) -> None:
        raise RuntimeError("sink gone")

    with helm_lines(broken):
        os.write(2, b"a line of someone else's\n")
        os.write(2, b"2026/11/28 15:34:06 WARN something Helm says\n")
    err = capfd.readouterr().err
    assert "a line of someone else's\n" in err
    assert "2026/11/28 15:34:06 WARN something Helm says\n" in err  # as it came, not lost
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"  # stderr is itself again


def test_go_log_lines_are_told_by_their_timestamp() -> None:
    assert go_log_line("2026/11/28 15:34:06 INFO found symbolic link") == "INFO found symbolic link"
    assert go_log_line("2026/11/28 15:34:06.123456 msg") == "msg"
    assert go_log_line("kelastic: something") is None
