"""A callable rank that returned stays alive until released (kelastic.agent.multiprocessing.handshake).

Why it matters: a gloo rank that returns without ``destroy_process_group`` and exits at
once can die of SIGABRT in its interpreter's finalisation, and a finished job is then
reported as failed. ``finish_probe.py`` reproduces that; the slow tests here run it
many times on the launcher and on two agents and must never see a failure.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kelastic.agent import warm
from kelastic.agent.api import WorkerSpec
from kelastic.agent.local_agent import LocalElasticAgent
from kelastic.agent.multiprocessing import DefaultLogsSpecs, PContext, start_processes

SCRIPTS = Path(__file__).parent / "scripts"
PROBE = SCRIPTS / "finish_probe.py"


probe_module = SimpleNamespace(**runpy.run_path(str(PROBE)))
alive = runpy.run_path(str(SCRIPTS / "rank_helpers.py"))["alive"]


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def helpers(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``rank_helpers`` imported by name, so that spawned and forkserver ranks find its functions."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import rank_helpers

    return rank_helpers


@pytest.fixture
def contexts() -> Iterator[list[PContext]]:
    started: list[PContext] = []
    yield started
    for ctx in started:
        ctx.close(timeout=5)


def _start(contexts: list[PContext], *args: Any, **kwargs: Any) -> PContext:
    ctx = start_processes(*args, **kwargs)
    contexts.append(ctx)
    return ctx


def _script(tmp_path: Path) -> Path:
    """A script for warm.run_script: argv is ``rank marker go``, as return_when's arguments."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            rank, marker, go = sys.argv[1:4]
            deadline = time.monotonic() + 60
            while go != "-" and not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.02)
            open(marker, "w").write(str(os.getpid()))
            """
        )
    )
    return script


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_rank_that_returned_without_destroying_its_group_has_it_destroyed(
    method: str, tmp_path: Path, helpers: ModuleType, contexts: list[PContext]
) -> None:
    """The group a rank's function left initialized is destroyed once the rank is released,
    while its interpreter is whole (child.py says why), and the rank still ends with 0."""
    marker = tmp_path / "destroyed"
    ctx = _start(
        contexts,
        "d",
        helpers.gloo_return_noting_destroy,
        {0: (str(marker), str(tmp_path / "init"))},
        {0: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
        start_method=method,
    )
    result = ctx.wait(timeout=120, period=0.05)
    assert result is not None and not result.is_failed(), result
    assert result.return_values == {0: 7}
    assert marker.read_text() == "True"


@pytest.mark.parametrize(
    ("method", "warm_script"),
    [("spawn", False), ("fork", False), ("forkserver", False), ("forkserver", True)],
    ids=["spawn", "fork", "forkserver", "warm-script"],
)
def test_a_rank_that_returned_waits_for_its_local_peers(
    method: str, warm_script: bool, tmp_path: Path, helpers: ModuleType, contexts: list[PContext]
) -> None:
    markers = [tmp_path / "returned0", tmp_path / "returned1"]
    go = tmp_path / "go"
    if warm_script:
        script = str(_script(tmp_path))
        entry: Any = warm.run_script
        args = {0: (script, "0", str(markers[0]), "-"), 1: (script, "1", str(markers[1]), str(go))}
    else:
        entry = helpers.return_when
        args = {0: (0, str(markers[0]), ""), 1: (1, str(markers[1]), str(go))}
    ctx = _start(contexts, "f", entry, args, {0: {}, 1: {}}, tmp_path / "logs", start_method=method)
    wait_until(markers[0].exists, 60, "rank 0 to return")
    pid0 = ctx.pids()[0]
    assert ctx.wait(timeout=1.0, period=0.05) is None  # rank 1 still runs
    assert alive(pid0), "rank 0 exited while its local peer still ran"
    go.touch()
    result = ctx.wait(timeout=60, period=0.05)
    assert result is not None and not result.is_failed(), result
    assert result.return_values == ({0: None, 1: None} if warm_script else {0: 0, 1: 1})
    assert not alive(pid0)


def test_held_ranks_exit_only_when_released(
    tmp_path: Path, helpers: ModuleType, contexts: list[PContext]
) -> None:
    args = {r: (r, str(tmp_path / f"returned{r}"), "") for r in range(2)}
    ctx = _start(contexts, "h", helpers.return_when, args, {0: {}, 1: {}}, tmp_path / "logs", hold=True)
    wait_until(lambda: ctx.returned() is not None, 60, "both ranks to return")
    held = ctx.returned()
    assert held is not None and held.return_values == {0: 0, 1: 1} and not held.is_failed()
    pids = ctx.pids()
    assert ctx.wait(timeout=1.0, period=0.05) is None
    assert all(alive(p) for p in pids.values()), "a held rank exited before its release"
    ctx.release()
    result = ctx.wait(timeout=60, period=0.05)
    assert result is not None and result.return_values == {0: 0, 1: 1}
    assert not any(alive(p) for p in pids.values())


def test_a_rank_killed_while_it_waits_fails_the_run_and_blocks_nobody(
    tmp_path: Path, helpers: ModuleType, contexts: list[PContext]
) -> None:
    go = tmp_path / "go"
    args = {0: (0, str(tmp_path / "returned0"), ""), 1: (1, str(tmp_path / "returned1"), str(go))}
    ctx = _start(
        contexts, "k", helpers.return_when, args, {0: {}, 1: {}}, tmp_path / "logs", start_method="fork"
    )
    wait_until((tmp_path / "returned0").exists, 60, "rank 0 to return")
    os.kill(ctx.pids()[0], signal.SIGKILL)
    result = ctx.wait(timeout=60, period=0.05)
    # as torch: a rank that returned and then died failed; the peer the launcher stopped did not
    assert result is not None and {r: f.exitcode for r, f in result.failures.items()} == {0: -signal.SIGKILL}


LAUNCHER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[2])
    import rank_helpers
    from kelastic.agent.multiprocessing import start_processes

    if __name__ == "__main__":
        args = {r: (r, f"{sys.argv[1]}/returned{r}", "") for r in range(2)}
        ctx = start_processes("l", rank_helpers.return_when, args, {0: {}, 1: {}}, f"{sys.argv[1]}/logs",
                              start_method="forkserver", hold=True)
        while ctx.returned() is None:
            ctx.wait(timeout=0.05, period=0.05)
        print(json.dumps(list(ctx.pids().values())), flush=True)
        ctx.wait()  # held: until this process is killed
    """
)


def test_held_ranks_do_not_outlive_a_killed_launcher(tmp_path: Path) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(SCRIPTS)], stdout=subprocess.PIPE, text=True
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the launcher printed no pids"
        pids = json.loads(line)
        assert all(alive(p) for p in pids)
        proc.kill()
        proc.wait(10)
        wait_until(
            lambda: not any(alive(p) for p in pids), 10, f"held ranks {pids} to go with their launcher"
        )
    finally:
        proc.kill()
        proc.wait(10)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# --- the probe, many times -------------------------------------------------------------------


def _run_probe(mode: str, runs: int, timeout: float) -> None:
    proc = subprocess.run(
        [sys.executable, str(PROBE), mode, "--impl", "kelastic", "--runs", str(runs)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if " run " in line or "runs failed" in line]
    assert proc.returncode == 0, "\n".join(lines) + "\n" + proc.stderr[-3000:]
    assert f"0 of {runs} runs failed" in proc.stdout


# Before ranks waited for their peers, 7 launcher runs in 18 failed here and 8 agent runs in
# 12 (one run takes 8 to 20 s on 2 cores). Six launcher runs would all pass by chance with a
# probability of about 0.6**6 (5%), four agent runs with 0.33**4 (1%), both together (the
# wait is the same code) with under 0.1%. More runs: KELASTIC_FINISH_*_RUNS.
LAUNCHER_RUNS = int(os.environ.get("KELASTIC_FINISH_LAUNCHER_RUNS", "6"))
AGENT_RUNS = int(os.environ.get("KELASTIC_FINISH_AGENT_RUNS", "4"))


@pytest.mark.slow
def test_gloo_ranks_ending_without_destroy_never_fail_the_launcher() -> None:
    _run_probe("launcher", LAUNCHER_RUNS, timeout=120 * LAUNCHER_RUNS)


@pytest.mark.slow
def test_gloo_ranks_ending_without_destroy_never_fail_two_agents() -> None:
    _run_probe("agent", AGENT_RUNS, timeout=180 * AGENT_RUNS)


# --- ranks on other nodes --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(fn: Any, endpoint: str, run_id: str, is_host: bool, barrier: float, log_dir: str, out: Any) -> None:
    spec = probe_module.c10d_spec(
        WorkerSpec, fn, (str(Path(log_dir) / "pid0"),), endpoint, run_id, is_host, nodes=2, local_world_size=1
    )
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=log_dir), "spawn", barrier)
    began = time.monotonic()
    result = agent.run()
    out.put((result.is_failed(), result.return_values, time.monotonic() - began))


def _two_nodes(fn: Any, tmp_path: Path, barrier: float) -> tuple[list[Any], Any]:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    endpoint, run_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex[:8]
    nodes = [
        ctx.Process(target=_node, args=(fn, endpoint, run_id, i == 0, barrier, str(tmp_path), out))
        for i in (0, 1)
    ]
    for p in nodes:
        p.start()
    return nodes, out


@pytest.mark.slow
def test_a_worker_stays_alive_until_the_workers_of_other_nodes_returned(
    tmp_path: Path, helpers: ModuleType
) -> None:
    nodes, out = _two_nodes(helpers.return_or_check, tmp_path, barrier=60)
    try:
        results = [out.get(timeout=180) for _ in nodes]
        for p in nodes:
            p.join(30)
        assert [p.exitcode for p in nodes] == [0, 0]
        assert [failed for failed, _, _ in results] == [False, False]
        values = {rank: v for _, vals, _ in results for rank, v in vals.items()}
        # rank 1 ran a second longer than rank 0, on another node, and found it alive
        assert values == {0: True, 1: True}
    finally:
        for p in nodes:
            p.kill()


@pytest.mark.slow
def test_a_held_worker_is_released_when_a_peer_node_is_gone(tmp_path: Path, helpers: ModuleType) -> None:
    barrier = 3.0
    nodes, out = _two_nodes(helpers.return_or_hang, tmp_path, barrier=barrier)
    try:
        pid0, agent1 = tmp_path / "pid0", tmp_path / "pid0.agent1"
        wait_until(lambda: pid0.exists() and agent1.exists(), 120, "both workers to start")
        held = int(pid0.read_text())
        os.kill(int(agent1.read_text()), signal.SIGKILL)  # that node is gone; its worker dies with it
        failed, values, _ = out.get(timeout=barrier + 60)
        # the exit barrier gave up after its timeout; the held worker was released and exited
        assert not failed and values == {0: True}
        wait_until(lambda: not alive(held), 30, "the released worker to exit")
    finally:
        for p in nodes:
            p.kill()
