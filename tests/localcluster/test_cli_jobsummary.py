"""``kelastic local run``'s per-job summary: the pure part, and a real run whose world size changes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kelastic.localcluster.cli.jobsummary import JobSample, parse_step, render, summarize


def test_parse_step() -> None:
    assert parse_step("120/500 (24%)") == 120
    assert parse_step("step 7") == 7
    assert parse_step(None) is None and parse_step("") is None


def test_segments_rates_recoveries_and_causes() -> None:
    def s(t: float, world: int, step: int | None, restarts: int = 0) -> JobSample:
        return JobSample(time=100 + t, phase="Running", world_size=world, restarts=restarts, step=step)

    samples = [
        s(0, 0, None),
        s(1, 3, 0),
        s(2, 3, 10),
        s(5, 3, 40),  # 10 steps/s at world 3
        s(6, 3, 40),
        s(7, 2, 40),  # a worker lost
        s(8, 2, 40),
        s(9, 2, 35, restarts=1),  # resumed from a checkpoint
        s(13, 2, 55, restarts=1),  # 5 steps/s at world 2
    ]
    events = [{"reason": "RecreateWorker", "count": 2}, {"reason": "CreateWorker"}, {"reason": "NoProgress"}]
    summary = summarize("train", samples, events)
    assert summary.duration == 13 and summary.restarts == 1 and summary.phase == "Running"
    assert [(g.world_size, g.start, g.end) for g in summary.segments] == [(3, 1, 6), (2, 7, 13)]
    assert summary.segments[0].steps_per_second == pytest.approx(10.0)
    assert summary.segments[1].steps_per_second == pytest.approx(5.0)  # 35 -> 55 after the restart
    # last step change at world 3 was at t=5, the first at world 2 at t=9
    assert summary.recoveries == ((3, 2, 4.0),)
    assert summary.causes == (("RecreateWorker", 2), ("NoProgress", 1))
    text = "\n".join(render(summary))
    assert "job train: Running after 13.0s, 1 re-form(s)" in text
    assert "worker failed and was recreated x2" in text and "ranks hung (no progress) x1" in text
    assert "world size   3 from    1.0s to    6.0s: 10.00 steps/s" in text
    assert "recovery 3 -> 2: 4.0s from the last step to the next" in text


def test_a_job_without_progress_reports_says_so() -> None:
    samples = [JobSample(0, "Running", 2, 0, None), JobSample(1, "Succeeded", 2, 0, None)]
    assert "no progress reported" in "\n".join(render(summarize("j", samples)))


TRAIN = """
import os, signal, sys, time
import torch, torch.distributed as dist
from kelastic.agent.progress import update
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lost-once")
step = int(open("ckpt").read()) if os.path.exists("ckpt") else 0  # written atomically below
while step < 280:
    t = torch.ones(1)
    dist.all_reduce(t)
    step += 1
    update(step, 280)
    if rank == 0:
        open("ckpt.tmp", "w").write(str(step))
        os.replace("ckpt.tmp", "ckpt")
    # 120 steps (12 s and more) at world 2: the job's PROGRESS moves every few seconds, and a
    # loaded machine delays it further; the stretch must hold two samples of it.
    if step == 120 and world == 2 and os.environ["KELASTIC_NODE_NAME"].endswith("-1") and not os.path.exists(marker):
        open(marker, "w").write("")
        os.kill(os.getppid(), signal.SIGKILL)  # the whole pod goes: its agent dies with it
    time.sleep(0.1)
dist.destroy_process_group()
"""

JOB = """
apiVersion: kelastic.dev/v1alpha1
kind: ElasticJob
metadata:
  name: summary-demo
spec:
  minReplicas: 1
  maxReplicas: 2
  warmStart: false
  backoffLimit: 3
  replicaSpecs:
    Worker:
      replicas: 2
      restartPolicy: OnFailure
      template:
        spec:
          # The recreated worker waits before it joins, so the job runs at world 1 for a
          # while whatever the machine's speed (a fast rejoin would leave no sample at 1).
          initContainers:
          - name: hold
            image: kelastic:dev
            command: ["python", "-c", "import os, time; time.sleep(5 if os.path.exists('lost-once') else 0)"]
          containers:
          - name: trainer
            image: kelastic:dev
            command: ["python", "train.py"]
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_run_prints_speed_per_world_size_and_the_recovery(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    (tmp_path / "job.yaml").write_text(JOB)
    kelastic = shutil.which("kelastic")
    command = [kelastic] if kelastic else [sys.executable, "-m", "kelastic.localcluster"]
    proc = subprocess.run(
        [*command, "local", "run", "--timeout", "300", "job.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=360,
        env={k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    summary = output[output.rindex("kelastic: summary") :]
    print(summary)
    assert re.search(r"job summary-demo: Succeeded after \d+\.\ds, \d+ re-form\(s\)", summary), summary
    assert "causes: worker failed and was recreated x1" in summary, summary
    sizes = re.findall(r"world size +(\d) from [^:]*: (no progress reported|(\d+\.\d+) steps/s)", summary)
    assert [w for w, _, _ in sizes] == ["2", "1", "2"], summary
    # the job's PROGRESS moves every few seconds: the short stretch at 1 may show no rate
    assert sizes[0][2] and sizes[2][2] and all(0 < float(r) < 20 for _, _, r in sizes if r), summary
    (took,) = re.findall(r"recovery 2 -> 1: (\d+\.\d)s", summary)
    assert 0 < float(took) < 60
