"""start_processes with real binaries and callables: arguments, environments, logs, results."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from kelastic.agent.multiprocessing import (
    MultiprocessContext,
    ProcessFailure,
    RunProcsResult,
    Std,
    SubprocessContext,
    record,
    start_processes,
)


@pytest.fixture
def contexts():
    """Collects started contexts and closes them all at the end of the test."""
    started = []
    yield started
    for ctx in started:
        ctx.close(timeout=5)


def launch(contexts, *args, **kwargs):
    ctx = start_processes(*args, **kwargs)
    contexts.append(ctx)
    return ctx


def test_touch_binary_creates_files(tmp_path: Path, contexts) -> None:
    targets = {0: (tmp_path / "file1",), 1: (tmp_path / "file2",)}
    ctx = launch(contexts, "touch", "/usr/bin/touch", targets, {0: {}, 1: {}}, tmp_path / "logs")
    assert isinstance(ctx, SubprocessContext)
    result = ctx.wait(timeout=10)
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: None, 1: None}
    assert (tmp_path / "file1").is_file() and (tmp_path / "file2").is_file()


def test_echo_casts_arguments_and_redirects(tmp_path: Path, contexts) -> None:
    args = {0: (1, 2, 3), 1: ([1, 2, 3],)}
    ctx = launch(
        contexts, "echo", "/usr/bin/echo", args, {0: {}, 1: {}}, tmp_path / "logs", redirects=Std.OUT
    )
    result = ctx.wait(timeout=10)
    assert result is not None and not result.is_failed()
    assert Path(result.stdouts[0]).read_text() == "1 2 3\n"
    assert Path(result.stdouts[1]).read_text() == "[1, 2, 3]\n"
    assert result.stdouts[0] == str(tmp_path / "logs" / "0" / "stdout.log")
    assert result.stderrs == {0: "", 1: ""}  # stderr was not redirected


def test_tee_prints_with_rank_header(tmp_path: Path, contexts, capfd) -> None:
    args = {0: ("-c", "echo hello; echo oops >&2"), 1: ("-c", "printf 'no newline'")}
    ctx = launch(
        contexts, "w", "/bin/sh", args, {0: {}, 1: {}}, tmp_path / "logs", tee={0: Std.ALL, 1: Std.OUT}
    )
    assert ctx.wait(timeout=10) is not None
    out, err = capfd.readouterr()
    assert "[w0]:hello\n" in out
    assert "[w1]:no newline\n" in out
    assert "[w0]:oops\n" in err
    assert (tmp_path / "logs" / "0" / "stdout.log").read_text() == "hello\n"


def test_envs_missing_rank_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"envs is missing local ranks \[1\]"):
        start_processes("x", "/usr/bin/true", {0: (), 1: ()}, {0: {}}, tmp_path / "logs")
    with pytest.raises(ValueError, match=r"args is missing local ranks \[1\].*extra keys \[2\]"):
        start_processes("x", "/usr/bin/true", {0: (), 2: ()}, {0: {}, 1: {}}, tmp_path / "logs")
    with pytest.raises(ValueError, match=r"envs\[0\] must map str to str.*'PORT'"):
        start_processes("x", "/usr/bin/true", {0: ()}, {0: {"PORT": 29500}}, tmp_path / "logs")  # type: ignore[dict-item]
    assert not (tmp_path / "logs").exists()


def test_non_empty_log_dir_and_bad_inputs_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "old.txt").write_text("previous attempt")
    with pytest.raises(ValueError, match="is not empty"):
        start_processes("x", "/usr/bin/true", {0: ()}, {0: {}}, tmp_path / "logs")
    with pytest.raises(ValueError, match="not found"):
        start_processes("x", "/no/such/binary", {0: ()}, {0: {}}, tmp_path / "l2")
    with pytest.raises(ValueError, match="start_method"):
        start_processes("x", math.sqrt, {0: (1,)}, {0: {}}, tmp_path / "l3", start_method="thread")
    with pytest.raises(TypeError):
        start_processes("x", 42, {0: ()}, {0: {}}, tmp_path / "l4")  # type: ignore[arg-type]


def test_envs_reach_binaries_with_error_file(tmp_path: Path, contexts) -> None:
    args = {0: ("-c", 'echo "$FOO $TORCHELASTIC_ERROR_FILE"')}
    ctx = launch(contexts, "env", "/bin/sh", args, {0: {"FOO": "bar"}}, tmp_path / "logs", redirects=Std.OUT)
    result = ctx.wait(timeout=10)
    assert result is not None
    assert Path(result.stdouts[0]).read_text() == f"bar {tmp_path / 'logs' / '0' / 'error.json'}\n"


def test_exit_code_7_fails_and_stops_other_ranks(tmp_path: Path, contexts) -> None:
    args = {0: ("-c", "sleep 300"), 1: ("-c", "sleep 0.2; exit 7")}
    ctx = launch(contexts, "t", "/bin/sh", args, {0: {}, 1: {}}, tmp_path / "logs")
    pids = ctx.pids()
    begin = time.monotonic()
    result = ctx.wait(timeout=60, period=30)
    assert time.monotonic() - begin < 20  # woke on the exit, not after a period
    assert result is not None and result.is_failed()
    # the failed rank, and the rank the launcher stopped because of it (as torch reports it)
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: -15, 1: 7}
    failure = result.failures[1]
    assert failure.exitcode == 7 and failure.pid == pids[1]
    # no error file: torch's message (the exit code is a field of its own)
    assert failure.message.startswith("To enable traceback see:")
    assert result.root_failure() is failure
    assert not os.path.exists(f"/proc/{pids[0]}")  # the sleeping rank was stopped and reaped


def test_signal_death_is_named(tmp_path: Path, contexts) -> None:
    ctx = launch(contexts, "k", "/bin/sh", {0: ("-c", "kill -9 $$")}, {0: {}}, tmp_path / "logs")
    result = ctx.wait(timeout=10)
    assert result is not None
    failure = result.failures[0]
    assert failure.exitcode == -9
    assert failure.signal_name() == "SIGKILL"
    assert "Signal 9 (SIGKILL)" in failure.message


def test_binary_error_file_is_read(tmp_path: Path, contexts) -> None:
    script = 'echo \'{"message": "disk full", "traceback": "tb", "timestamp": 5}\' > $TORCHELASTIC_ERROR_FILE; exit 3'
    ctx = launch(contexts, "e", "/bin/sh", {0: ("-c", script)}, {0: {}}, tmp_path / "logs")
    result = ctx.wait(timeout=10)
    assert result is not None
    failure = result.failures[0]
    assert failure.message == "disk full"
    assert failure.timestamp == 5
    assert failure.error_file_data is not None and failure.error_file_data["traceback"] == "tb"


def _raise_value_error(text: str) -> None:
    raise ValueError(text)


def _read_env(name: str) -> str:
    return os.environ[name]


def test_raising_callable_reports_error_file(tmp_path: Path, contexts) -> None:
    ctx = launch(
        contexts,
        "r",
        _raise_value_error,
        {0: ("bad learning rate",)},
        {0: {}},
        tmp_path / "logs",
        start_method="fork",
        redirects=Std.ERR,
    )
    assert isinstance(ctx, MultiprocessContext)
    result = ctx.wait(timeout=20)
    assert result is not None
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert failure.message == "ValueError: bad learning rate"
    data = json.loads((tmp_path / "logs" / "0" / "error.json").read_text())
    assert data["message"]["message"] == "ValueError: bad learning rate"  # torch's layout
    extra = data["message"]["extraInfo"]
    assert "_raise_value_error" in extra["py_callstack"] and int(extra["timestamp"]) > 0
    assert "ValueError: bad learning rate" in (tmp_path / "logs" / "0" / "stderr.log").read_text()
    assert "bad learning rate" in result.summary()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_callable_return_values(tmp_path: Path, contexts, method: str) -> None:
    ctx = launch(
        contexts,
        "p",
        math.pow,
        {0: (2, 3), 1: (3, 2)},
        {0: {}, 1: {}},
        tmp_path / "logs",
        start_method=method,
    )
    result = ctx.wait(timeout=30)
    assert result is not None and not result.is_failed(), result.summary()
    assert result.return_values == {0: 8.0, 1: 9.0}


def test_callable_gets_env(tmp_path: Path, contexts) -> None:
    envs = {0: {"KELASTIC_T": "zero"}, 1: {"KELASTIC_T": "one"}}
    ctx = launch(
        contexts,
        "v",
        _read_env,
        {0: ("KELASTIC_T",), 1: ("KELASTIC_T",)},
        envs,
        tmp_path / "l",
        start_method="fork",
    )
    result = ctx.wait(timeout=20)
    assert result is not None and result.return_values == {0: "zero", 1: "one"}


def test_record_writes_error_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "err.json"))

    @record
    def main() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        main()
    data = json.loads((tmp_path / "err.json").read_text())
    assert set(data) == {"message"} and set(data["message"]) == {"message", "extraInfo"}
    assert data["message"]["message"] == "RuntimeError: boom"


def test_root_failure_is_earliest() -> None:
    late = ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file="", timestamp=200.0)
    early = ProcessFailure(local_rank=1, pid=11, exitcode=-15, error_file="", timestamp=100.0)
    result = RunProcsResult(failures={0: late, 1: early})
    assert result.root_failure() is early
    assert "Signal 15 (SIGTERM)" in early.message
    assert result.summary().startswith("root cause (first failure): local_rank 1")


def test_std_parsing() -> None:
    assert Std.from_str("3") == Std.ALL
    assert Std.from_str("0:1,1:2") == {0: Std.OUT, 1: Std.ERR}
    with pytest.raises(ValueError, match="invalid std stream mask"):
        Std.from_str("7")
