"""The hand-off between an agent and the workers it keeps (kelastic.agent.handoff, .keep), and
``kelastic.inprocess.run`` outside a kelastic agent: pure decisions, files and real processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kelastic.agent import handoff
from kelastic.agent.handoff import Action, Report, Request, Stage
from kelastic.agent.keep import Keeper, KeptWorkers, alive


def _report(gen: int = 0, pid: int = 10, stage: Stage = Stage.RUNNING, reason: str = "") -> Report:
    return Report(gen, pid, stage, 12, reason)


def test_every_worker_must_have_reported_from_its_own_process_in_this_generation() -> None:
    assert handoff.keepable({0: _report(), 1: _report(pid=11)}, {0: 10, 1: 11}, 0)
    assert handoff.keepable({0: _report(stage=Stage.PARKED)}, {0: 10}, 0)
    assert not handoff.keepable({0: _report()}, {0: 10, 1: 11}, 0)  # rank 1 never reported
    assert not handoff.keepable({0: _report(pid=9)}, {0: 10}, 0)  # another process's report
    assert not handoff.keepable({0: _report(gen=1)}, {0: 10}, 0)
    assert not handoff.keepable({0: _report(stage=Stage.DONE)}, {0: 10}, 0)
    assert not handoff.keepable({}, {}, 0)


def test_parked_and_failed_on_its_own() -> None:
    asked, raised = _report(stage=Stage.PARKED), _report(stage=Stage.PARKED, reason="RuntimeError: x")
    assert handoff.parked({0: asked, 1: raised}, 2, 0)
    assert not handoff.parked({0: asked}, 2, 0)
    assert not handoff.parked({0: asked, 1: _report()}, 2, 0)
    assert handoff.failed_on_its_own(raised, 0)
    assert not handoff.failed_on_its_own(asked, 0)  # parked because the agent asked
    assert not handoff.failed_on_its_own(raised, 1)
    assert not handoff.failed_on_its_own(None, 0)


def test_files_round_trip_and_anything_else_reads_as_nothing(tmp_path: Path) -> None:
    request = Request(3, Action.GO, {"RANK": "2", "WORLD_SIZE": "4"})
    handoff.write_request(tmp_path, request)
    assert handoff.read_request(tmp_path) == request
    handoff.write_report(tmp_path, _report(reason="E: 1"))
    assert handoff.read_report(tmp_path) == _report(reason="E: 1")
    for junk in (
        "",
        "[1]",
        "{",
        '{"gen": 1}',
        '{"gen": "x", "pid": 1, "stage": "running"}',
        '{"gen": 1, "action": "fly"}',
    ):
        handoff.request_path(tmp_path).write_text(junk)
        handoff.report_path(tmp_path).write_text(junk)
        assert handoff.read_request(tmp_path) is None
        assert handoff.read_report(tmp_path) is None
    assert not list(tmp_path.glob(".*.tmp"))


def test_keep_can_be_turned_off() -> None:
    assert handoff.keep_enabled({})
    assert not handoff.keep_enabled({handoff.ENV_KEEP_WORKERS: "0"})
    assert not Keeper(enabled=False).started(Path("/nonexistent/attempt_0"), 2)[1]


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_workers_that_never_park_are_stopped_and_not_kept(tmp_path: Path) -> None:
    keeper = Keeper()
    folders = keeper.started(tmp_path / "attempt_0", 1)
    folder = Path(folders[0][handoff.ENV_HANDOFF_DIR])
    proc = _sleeper()
    try:
        handoff.write_report(folder, Report(0, proc.pid, Stage.RUNNING))
        stopped: list[bool] = []
        done: list[float] = []
        kept = keeper.begin(
            {0: proc.pid}, lambda: stopped.append(proc.kill() is None), lambda s, e: done.append(s)
        )
        assert isinstance(kept, KeptWorkers)
        assert handoff.read_request(folder) == Request(1, Action.REFORM)
        kept._timeout = 0.3  # the process never parks: it is stopped
        kept.wait()
        assert stopped and not kept.kept and done
    finally:
        proc.kill()
        proc.wait()


def test_workers_that_park_are_handed_the_next_group(tmp_path: Path) -> None:
    keeper = Keeper()
    folder = Path(keeper.started(tmp_path / "attempt_0", 1)[0][handoff.ENV_HANDOFF_DIR])
    proc = _sleeper()
    try:
        handoff.write_report(folder, Report(0, proc.pid, Stage.PARKED))
        kept = keeper.begin({0: proc.pid}, lambda: pytest.fail("stopped"), lambda s, e: None)
        assert kept is not None
        kept.wait()
        assert kept.kept
        keeper.hand_over(kept, {0: {"RANK": "1"}})
        assert keeper.gen == 1
        assert handoff.read_request(folder) == Request(1, Action.GO, {"RANK": "1"})
    finally:
        proc.kill()
        proc.wait()
    assert not alive(proc.pid)
    assert keeper.begin({0: proc.pid}, lambda: None, lambda s, e: None) is None  # gone: not kept


def test_only_the_agents_user_may_write_a_hand_off_file() -> None:
    me, other = 1000, 1001
    assert handoff.unsafe_mode(stat.S_IFDIR | 0o700, me, me, directory=True) is None
    assert handoff.unsafe_mode(stat.S_IFREG | 0o644, me, me, directory=False) is None
    assert "uid 1001" in str(handoff.unsafe_mode(stat.S_IFDIR | 0o700, other, me, directory=True))
    assert "mode 777" in str(handoff.unsafe_mode(stat.S_IFDIR | 0o777, me, me, directory=True))
    assert "mode 664" in str(handoff.unsafe_mode(stat.S_IFREG | 0o664, me, me, directory=False))
    assert "symbolic link" in str(handoff.unsafe_mode(stat.S_IFLNK | 0o777, me, me, directory=True))
    assert "not a directory" in str(handoff.unsafe_mode(stat.S_IFREG | 0o700, me, me, directory=True))


def test_a_request_someone_else_could_have_written_reads_as_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "handoff_attempt_0" / "0"
    assert handoff.make_private(folder) is None
    request = Request(1, Action.GO, {"MASTER_ADDR": "10.0.0.9"})
    path = handoff.request_path(folder)
    handoff.write_request(folder, request)
    assert handoff.read_request(folder) == request
    path.chmod(0o666)
    assert handoff.read_request(folder) is None, "a world-writable request was taken"
    path.chmod(0o644)
    if os.geteuid() == 0:  # root can give the file away, as another user's would be
        os.chown(path, 65534, 65534)
        assert handoff.read_request(folder) is None, "another user's request was taken"
    path.unlink()
    forged = tmp_path / "forged.json"
    forged.write_text('{"gen": 1, "action": "go", "env": {}}')
    path.symlink_to(forged)
    assert handoff.read_request(folder) is None, "a symbolic link was followed"


def test_the_agent_keeps_no_worker_whose_hand_off_folder_it_cannot_make_private(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = os.umask(0)  # a container's umask: new folders open to everyone unless made private
    try:
        envs = Keeper().started(tmp_path / "attempt_0", 1)
    finally:
        os.umask(old)
    folder = Path(envs[0][handoff.ENV_HANDOFF_DIR])
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    assert handoff.unsafe(folder) is None

    planted = tmp_path / "handoff_attempt_1"  # made before the agent, by someone else
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    if os.geteuid() == 0:
        os.chown(planted, 65534, 65534)
    keeper = Keeper()
    with caplog.at_level("ERROR"):
        assert keeper.started_early(tmp_path / "attempt_1", 2) == {}
        assert keeper.started(tmp_path / "attempt_1", 2) == {0: {}, 1: {}}
    assert not keeper.folders and not keeper.early
    assert "handoff_attempt_1" in caplog.text and "not kept" in caplog.text


def _one_rank_env(ports: int) -> dict[str, str]:
    """This environment without the agent's variables, for a group of one (a port from ``ports``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KELASTIC_", "TORCHELASTIC_"))}
    return env | {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(ports + os.getpid() % 1000),
    }


def test_a_worker_trains_without_being_kept_when_its_hand_off_folder_is_open_to_others(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import kelastic.inprocess\n"
        "print('result', kelastic.inprocess.run(lambda: kelastic.inprocess.generation(), backend='gloo'))\n"
    )
    open_folder = tmp_path / "open" / "0"
    open_folder.mkdir(parents=True)
    open_folder.chmod(0o777)
    env = _one_rank_env(30000) | {handoff.ENV_HANDOFF_DIR: str(open_folder)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "result 0" in out.stdout
    assert "writable by other users (mode 777)" in out.stderr and "not kept" in out.stderr, out.stderr
    assert not handoff.report_path(open_folder).exists(), "it reported into a folder others can write"

    env[handoff.ENV_HANDOFF_PARKED] = "1"  # started before its group: it has none to train in
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "started before its group" in out.stderr, out.stderr


def test_outside_an_agent_run_calls_the_function_once_in_its_group(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch.distributed as dist
            import kelastic.inprocess

            def train():
                assert dist.is_initialized() and dist.get_world_size() == 1
                return kelastic.inprocess.generation()

            print("result", kelastic.inprocess.run(train, backend="gloo"), dist.is_initialized())
            """
        )
    )
    env = _one_rank_env(29000)
    began = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "result 0 False" in out.stdout, (out.stdout, time.monotonic() - began)


def test_workers_started_early_are_waited_for_until_they_park_not_replaced(tmp_path: Path) -> None:
    keeper = Keeper()
    folder = Path(keeper.started_early(tmp_path / "attempt_0", 1)[0][handoff.ENV_HANDOFF_DIR])
    proc = _sleeper()
    try:
        # still importing when its group is known: it parks 0.3 s later
        timer = threading.Timer(0.3, lambda: handoff.write_report(folder, Report(0, proc.pid, Stage.PARKED)))
        timer.start()
        began = time.monotonic()
        assert keeper.take_early({0: proc.pid}, {0: {"RANK": "0"}}, wait=30)
        assert time.monotonic() - began >= 0.25
        assert handoff.read_request(folder) == Request(1, Action.GO, {"RANK": "0"})
    finally:
        proc.kill()
        proc.wait()

    keeper = Keeper()
    keeper.started_early(tmp_path / "attempt_1", 1)
    began = time.monotonic()
    assert not keeper.take_early({0: proc.pid}, {0: {}}, wait=30), "a worker that ended was counted on"
    assert time.monotonic() - began < 5, "a worker that ended was waited for"
    assert not keeper.take_early({0: proc.pid}, {0: {}}), "taken twice"
