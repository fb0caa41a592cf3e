"""End-to-end: the README's main command, `kelastic local run examples/elasticjob.yaml`.

Runs the CLI as a user would, from the repository checkout: it starts a local
cluster and the operator, applies the example, relays logs and progress, and
must exit 0 once the job Succeeded. Local mode only (it brings its own cluster).

It runs on the control-plane lane, the README's ``--control-plane`` form (the operator then
installed from the chart). The emulator's form, the same command without the flag, is run
as written by ``tests/localcluster/test_cli_run_output.py``, which checks what it prints in
more detail (these lines too): running it here as well proved nothing more.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("KELASTIC_E2E_REAL") == "1", reason="runs its own kelastic local cluster"
    ),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("lane", ["emulator", "control-plane"])
@pytest.mark.lanes("control-plane")
def test_readme_main_command_runs_the_example_to_success(
    lane: str, local_run: Callable[[list[str], str, float], tuple[int, str]]
) -> None:
    code, output = local_run(["--timeout", "300", "examples/elasticjob.yaml"], lane, 360)
    assert code == 0, f"kelastic local run exited {code}:\n{output[-4000:]}"
    # Readable logs and progress reached the terminal: the pods' output is relayed with their names.
    assert "[train] done: 300 steps" in output, output[-4000:]
    assert "train-example-worker-" in output
    assert "Succeeded" in output
