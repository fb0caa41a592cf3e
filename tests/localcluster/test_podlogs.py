"""The container log layout both log readers (the emulator, the kubelet's HTTPS endpoint) use."""

from __future__ import annotations

from pathlib import Path

import pytest

from kelastic.localcluster.common.podlogs import log_files, pod_log_dir, select_lines


def test_a_pods_logs_lie_under_namespace_name_and_uid(tmp_path: Path) -> None:
    assert pod_log_dir(tmp_path, "ns", "web", "u-1") == tmp_path / "pods" / "ns_web_u-1"


def test_runs_are_ordered_by_restart_count_not_by_name(tmp_path: Path) -> None:
    for name in ("10.log", "9.log", "0.log", "notes.log", "1.txt"):
        (tmp_path / name).write_text(name)
    assert [i for i, _ in log_files(tmp_path)] == [0, 9, 10]
    assert log_files(tmp_path / "absent") == []


@pytest.mark.parametrize(
    ("tail", "limit", "expected"),
    [
        (None, None, b"a\nb\nc"),
        (1, None, b"c"),
        (2, None, b"b\nc"),
        (0, None, b""),
        (9, None, b"a\nb\nc"),
        (None, 3, b"a\nb"),
        (2, 3, b"b\nc"),  # tailLines first, then limitBytes
        (2, 1, b"b"),
    ],
)
def test_tail_lines_then_limit_bytes(tail: int | None, limit: int | None, expected: bytes) -> None:
    assert select_lines(b"a\nb\nc", tail, limit) == expected
