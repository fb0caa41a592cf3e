"""The order in which test processes take modules: tests/module_seconds.json, longest first.

The root conftest sorts the collected modules by what each took in a full run (``make
test-durations`` writes the file), so that with ``-n`` the long modules start first and the
suite does not end on one started last.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECONDS = REPO / "tests" / "module_seconds.json"


def _recorded() -> dict[str, float]:
    return dict(json.loads(SECONDS.read_text()))


def test_every_module_the_file_names_exists() -> None:
    gone = sorted(module for module in _recorded() if not (REPO / module).is_file())
    assert not gone, (
        f"{SECONDS.name} names modules that are gone: {gone}; refresh it with `make test-durations`"
    )


def _collected_modules(*modules: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    order: list[str] = []
    for line in proc.stdout.splitlines():
        module = line.split("::")[0]
        if "::" in line and module not in order:
            order.append(module)
    return order


@pytest.mark.slow
def test_the_longest_module_is_collected_first_whatever_the_command_line_order() -> None:
    recorded = _recorded()
    fast = [
        m
        for m in recorded
        if m.startswith("tests/packaging/") and m != "tests/packaging/test_pkg_suite_order.py"
    ]
    shortest, longest = min(fast, key=recorded.__getitem__), max(fast, key=recorded.__getitem__)
    assert recorded[shortest] < recorded[longest]
    assert _collected_modules(shortest, longest) == [longest, shortest]
    assert _collected_modules(longest, shortest) == [longest, shortest]


@pytest.mark.slow
def test_with_n_each_module_runs_whole_in_one_test_process() -> None:
    modules = ("tests/agent/test_auth.py", "tests/agent/test_cli_args.py")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-n", "2", "-p", "no:cacheprovider", *modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    processes: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("[gw") and " PASSED " in line:
            worker, test = line.split()[0], line.split(" PASSED ")[1]
            processes.setdefault(test.split("::")[0], set()).add(worker)
    assert set(processes) == set(modules)
    assert all(len(workers) == 1 for workers in processes.values()), processes
