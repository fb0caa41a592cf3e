"""What ``kelastic local run`` prints: one voice, one tag per container, one progress line per
job, and a summary that is true once everything stopped. The end-to-end test runs the README's
command as written."""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kelastic.localcluster.cli.cli import RunEnd, _agent_progress_line, _summarize
from kelastic.localcluster.cli.completion import Outcome
from kelastic.localcluster.cli.logrelay import LogFollower, LogRelay

REPO = Path(__file__).resolve().parents[2]


def test_kelastic_speaks_in_one_voice_and_drops_the_agents_progress_lines() -> None:
    out: list[str] = []
    relay = LogRelay(write=out.append, drop=_agent_progress_line)
    relay.say("applied 2 object(s)")
    relay.line("job-worker-0/trainer", "[default progress] step 30/300 (10%) 9.31 step/s 1 rank")
    relay.line("job-worker-0/trainer", "[train] step 20/300 loss 3.47")
    assert out == [
        "kelastic: applied 2 object(s)\n",
        "[job-worker-0/trainer] [train] step 20/300 loss 3.47\n",
    ]


def test_a_pods_containers_are_tagged_alike_whichever_wrote_first(tmp_path: Path) -> None:
    """The init container writes alone first: its lines carry the container's name all the
    same, as the main container's will (the pod has two)."""
    logs = tmp_path / "pods" / "default_job-worker-1_uid1" / "kelastic-agent"
    logs.mkdir(parents=True)
    (logs / "0.log").write_text("installed the agent\n")
    out: list[str] = []
    asked: list[tuple[str, str]] = []

    def containers_of(namespace: str, name: str) -> int:
        asked.append((namespace, name))
        return 2

    follower = LogFollower(tmp_path, LogRelay(write=out.append), None, containers_of)
    follower.poll(0.0)
    trainer = logs.parent / "trainer"
    trainer.mkdir()
    (trainer / "0.log").write_text("training\n")
    follower.poll(1.0)
    assert out == ["[job-worker-1/kelastic-agent] installed the agent\n", "[job-worker-1/trainer] training\n"]
    assert asked == [("default", "job-worker-1")]  # once per pod


def test_the_summary_says_each_thing_once_and_what_was_true_at_the_end() -> None:
    job = {"kind": "ElasticJob", "metadata": {"name": "train-example"}}
    store = {
        "metadata": {"name": "train-example-rendezvous"},
        "status": {
            "phase": "Running",
            "containerStatuses": [{"name": "rendezvous", "state": {"running": {}}}],
        },
    }
    worker = {
        "metadata": {"name": "train-example-worker-0"},
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 0}}}],
        },
    }
    out = io.StringIO()
    code = _summarize(
        [job],
        [(Outcome.SUCCEEDED, "Succeeded: training finished")],
        [store, worker],
        41.7,
        RunEnd.FINISHED,
        "",
        argparse.Namespace(timeout=3600.0),
        out,
    )
    text = out.getvalue()
    assert code == 0
    assert "Succeeded   training finished" in text and "Succeeded: training" not in text
    assert "train-example-rendezvous  Stopped    stopped with the cluster (it was Running)" in text
    assert "train-example-worker-0    Succeeded  trainer: exit 0" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readmes_example_runs_as_written_and_prints_what_is_true(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "kelastic.localcluster", "local", "run", "examples/elasticjob.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
        env={**{k: v for k, v in os.environ.items() if k != "KUBECONFIG"}, "TMPDIR": str(scratch)},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    # Readable logs and progress reached the terminal: the pods' output is relayed with their
    # names (the README's command on the emulator lane: e2e/test_e2e_readme.py runs its
    # control-plane form).
    assert "[train] done: 300 steps" in output, output[-4000:]
    assert "train-example-worker-" in output and "Succeeded" in output, output[-4000:]
    lines = output.splitlines()
    # a run that succeeds says nothing to worry about: no pod's agent warned (a lost replica,
    # a refused request), and kelastic warned of nothing
    warned = [
        line for line in lines if re.match(r"(\[[^\]]+\] )?\[W \d\d:\d\d:\d\d\]", line) or "WARNING" in line
    ]
    assert not warned, "\n".join(warned[:10])
    # one voice: kelastic's own lines are "kelastic: ...", every other line is a pod's
    assert all(line.startswith(("kelastic:", "[", "  ")) for line in lines), output
    assert not [line for line in lines if line.startswith("[kelastic]")], output
    # one tag per container: the workers have an init container, so every line names its container
    tags = {m.group(1) for line in lines if (m := re.match(r"\[(train-example-worker-\d)(/[^\]]+)?\]", line))}
    assert tags and not [line for line in lines if re.match(r"\[train-example-worker-\d\] ", line)], output
    # one progress line per job: the agents' own progress lines are left to kubectl logs
    assert not [line for line in lines if "[default progress]" in line], output
    summary = output[output.rindex("kelastic: summary") :]
    assert "Succeeded   Succeeded" not in summary, summary
    # printed after the cluster stopped: no pod is said to be running (the store pod, which
    # the job's end deletes, may still have been when the cluster stopped: "it was Running")
    pods = summary[summary.index("  pods:\n") :].splitlines()[1:]
    states = {line.split()[1] for line in pods if line.startswith("    ")}
    assert states and states <= {"Succeeded", "Failed", "Stopped"}, summary
    # a log path printed is one that still exists
    for path in re.findall(r"log (/\S+?)[,)]", output):
        assert Path(path).exists(), f"{path} is printed but gone"
    # the agents leave nothing in the temporary directory
    assert not [p for p in scratch.rglob("*") if p.name.startswith("kelastic_")], sorted(scratch.rglob("*"))
