"""kelastic.agent.oom: a worker killed at the container's memory limit told from one killed
otherwise, by the memory cgroup's OOM kill counter (v2 and v1 files, as the kernel writes them)."""

from __future__ import annotations

from pathlib import Path

from kelastic.agent.oom import OOM_KILLED, OomWatch, counter_paths, oom_cause, parse_oom_kills, read_oom_kills
from kelastic.agent.restart_policy import Action, Failure, decide_after_failure

V2 = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"
V1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"


def test_the_counter_is_read_from_either_cgroup_version() -> None:
    assert parse_oom_kills(V2) == 2 and parse_oom_kills(V1) == 5
    assert parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n") is None  # a kernel before 4.13


def test_the_first_file_that_says_wins_and_none_is_none(tmp_path: Path) -> None:
    missing, v1 = tmp_path / "memory.events", tmp_path / "memory.oom_control"
    v1.write_text(V1)
    assert read_oom_kills((missing, v1)) == 5
    assert read_oom_kills((missing,)) is None


def test_the_counters_are_the_own_cgroups_first_then_the_mounts_roots() -> None:
    root = Path("/sys/fs/cgroup")
    v1 = "12:memory:/kubepods/pod1/abc\n11:cpu,cpuacct:/kubepods/pod1/abc\n0::/kubepods/pod1/abc\n"
    assert counter_paths(v1, root) == [
        root / "memory" / "kubepods/pod1/abc" / "memory.oom_control",
        root / "kubepods/pod1/abc" / "memory.events",
        root / "memory.events",
        root / "memory" / "memory.oom_control",
    ]
    assert counter_paths("0::/\n", root) == [root / "memory.events"] * 2 + [
        root / "memory" / "memory.oom_control"
    ]
    assert counter_paths("", root) == [root / "memory.events", root / "memory" / "memory.oom_control"]


def test_only_a_sigkill_while_the_counter_rose_is_an_oom_kill() -> None:
    assert oom_cause({1: -9}, 2, 3) == f"rank 1 was {OOM_KILLED}"
    assert oom_cause({1: -9, 3: -9, 0: 1}, 0, 1) == f"ranks 1, 3 were {OOM_KILLED}"
    assert oom_cause({1: -9}, 3, 3) == ""  # killed by someone else
    assert oom_cause({1: 1}, 2, 3) == ""  # crashed on its own; another process was OOM-killed
    assert oom_cause({1: -9}, None, 3) == "" and oom_cause({1: -9}, 3, None) == ""


def test_the_watch_says_each_kill_once(tmp_path: Path) -> None:
    counter = tmp_path / "memory.events"
    counter.write_text(V2)
    watch = OomWatch((counter,))
    assert watch.cause({1: -9}) == ""
    counter.write_text(V2.replace("oom_kill 2", "oom_kill 3"))
    assert watch.cause({1: -9}) == f"rank 1 was {OOM_KILLED}"
    assert watch.cause({1: -9}) == ""


def test_the_restart_reason_names_the_cause() -> None:
    verdict = decide_after_failure(
        Failure(
            state="FAILED",
            member_lost=False,
            remaining_restarts=2,
            max_restarts=3,
            cause=f"rank 1 was {OOM_KILLED}",
        )
    )
    assert verdict.action is Action.RESTART_SPEND
    assert verdict.reason == f"workers FAILED (rank 1 was {OOM_KILLED}); 1/3 restarts left after this"
