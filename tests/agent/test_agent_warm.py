"""Warm starts: the fork server is a fork of the agent (one ``import torch`` per node), and
the agent's start-up milestones are events with real timestamps.

Each scenario runs in a fresh interpreter, as ``kelastic-agent`` does: forking the fork
server is only done while a single thread runs, which a pytest process cannot promise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

#: Started with ``python SCRIPT [thread]``: forks (or, with a thread running, spawns) the
#: fork server, starts one worker through it, prints what the worker and the server saw.
SCRIPT = textwrap.dedent(
    """
    import gc, json, logging, multiprocessing, os, sys, threading

    from kelastic.agent import warm

    def worker(queue):
        queue.put({
            "modules": [m for m in warm.PRELOAD if m in sys.modules],
            "root_handlers": len(logging.getLogger().handlers),
            "root_level": logging.getLogger().level,
            "ppid": os.getppid(),
            "gc": gc.isenabled(),
            "frozen": gc.get_freeze_count(),
        })

    if __name__ == "__main__":
        logging.basicConfig(level=logging.INFO)  # the agent's own logging
        if sys.argv[1:] == ["thread"]:
            stop = threading.Event()
            threading.Thread(target=stop.wait, daemon=True).start()
        print("buffered before the fork")  # stdout is a pipe: block-buffered, not flushed
        forked = warm.fork_forkserver()
        # The server imports torch._dynamo for a second or more: not ready at once.
        early = warm.wait_ready(0)
        ready = warm.wait_ready(120)
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        ctx = multiprocessing.get_context("forkserver")
        queue = ctx.Queue()
        p = ctx.Process(target=worker, args=(queue,))
        p.start()
        seen = queue.get(timeout=120)
        p.join(60)
        with open(f"/proc/{server}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\\0", b" ").decode()
        with open(f"/proc/{server}/stat") as f:
            server_parent = int(f.read().rpartition(")")[2].split()[1])
        print(json.dumps({
            "forked": forked, "gc": gc.isenabled(), "early": early, "ready": ready, "again": warm.wait_ready(0), "worker": seen, "server": server, "server_cmdline": cmdline,
            "server_parent": server_parent, "me": os.getpid(), "exitcode": p.exitcode,
        }))
    """
)


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    script = tmp_path / "warm_probe.py"
    script.write_text(SCRIPT)
    # Buffered output, as for an agent whose stdout is a pipe (the default for a program).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    # Output pending at the fork is written once, not again by the server's children.
    assert proc.stdout.count("buffered before the fork") == 1, proc.stdout
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_the_fork_server_is_a_fork_of_the_agent_and_preloads_the_rest(tmp_path: Path) -> None:
    seen = _run(tmp_path)
    assert seen["forked"] is True
    # wait_ready: not yet right after the fork, then ready, then nothing left to wait for.
    assert (seen["early"], seen["ready"], seen["again"]) == (False, True, None)
    # A fork of the agent runs the agent's command line, not multiprocessing's -c main(...).
    assert "multiprocessing.forkserver" not in seen["server_cmdline"]
    assert "warm_probe.py" in seen["server_cmdline"]
    assert seen["server_parent"] == seen["me"]
    worker = seen["worker"]
    assert worker["ppid"] == seen["server"]
    # torch came from the agent's import, the rest from the server's own preload.
    assert worker["modules"] == [
        "torch",
        "torch.distributed",
        "torch._dynamo",
        "torch.distributed.checkpoint",
        "kelastic.checkpoint",
        "kelastic.agent.multiprocessing.child",
    ]
    # The agent's logging set-up is not the script's: basicConfig() in a script takes effect.
    assert (worker["root_handlers"], worker["root_level"]) == (0, 30)
    # The collector is on again in the agent and in the workers; what the server imported is
    # frozen (never scanned, its pages stay shared).
    assert seen["gc"] is True and worker["gc"] is True
    assert worker["frozen"] > 100_000
    assert seen["exitcode"] == 0


@pytest.mark.slow
def test_with_another_thread_running_the_fork_server_is_a_fresh_interpreter(tmp_path: Path) -> None:
    seen = _run(tmp_path, "thread")
    assert seen["forked"] is False
    assert seen["ready"] is None  # multiprocessing's own server: nothing of ours to wait for
    assert "from multiprocessing.forkserver import main" in seen["server_cmdline"]
    # multiprocessing's own server still preloads everything the workers should find.
    assert "torch._dynamo" in seen["worker"]["modules"]
    assert seen["gc"] is True
    assert seen["exitcode"] == 0


@pytest.mark.slow  # a real agent and workers
def test_the_agent_records_its_start_up_milestones(tmp_path: Path) -> None:
    events_file = tmp_path / "events.jsonl"
    script = tmp_path / "train.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    before = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kelastic.agent",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--warm-start",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "KELASTIC_EVENTS_FILE": str(events_file)},
    )
    after = time.time()
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    names = [e["name"] for e in events]
    assert names[:5] == [
        "kelastic.agent.started",
        "kelastic.agent.torch_imported",
        "kelastic.agent.warm_ready",  # the node joins the rendezvous once its server is ready
        "kelastic.agent.rendezvous",
        "kelastic.agent.workers_started",
    ], names
    started, imported, ready = events[0], events[1], events[2]
    assert ready["metadata"]["ready"] is True
    # The process start comes from the kernel: before the agent's first line, after we launched it.
    assert before - 0.05 <= started["metadata"]["process_start"] <= started["timestamp"] <= after
    assert imported["metadata"]["warm_forked"] is True
    assert 0 < imported["metadata"]["seconds"] <= imported["timestamp"] - started["timestamp"] + 0.01
