"""kelastic's launcher and agent API against torch.distributed.elastic's, side by side.

Where torch's own implementation (installed with torch) can run the same thing, a test is
parametrized over both and asserts the same outcome: what code written for torch's
``start_processes``, ``LogsSpecs``, error files, ``ProcessFailure``, ``record``,
``TailLog``, ``WorkerSpec`` and ``LocalElasticAgent`` sees on kelastic. Where kelastic
deliberately differs (see the docstrings of ``kelastic.agent.multiprocessing.api``,
``.errors`` and ``kelastic.agent.api``), the test says so.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import runpy
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch.distributed.elastic.agent.server.api as torch_agent_api
import torch.distributed.elastic.agent.server.local_elastic_agent as torch_local_agent
import torch.distributed.elastic.multiprocessing as torch_mp
import torch.distributed.elastic.multiprocessing.errors as torch_errors
import torch.distributed.elastic.multiprocessing.redirects as torch_redirects
import torch.distributed.elastic.multiprocessing.tail_log as torch_tail_log
import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

import kelastic.agent.api as k_agent_api
import kelastic.agent.local_agent as k_local_agent
import kelastic.agent.multiprocessing as k_mp
import kelastic.agent.multiprocessing.errors as k_errors
import kelastic.agent.multiprocessing.redirects as k_redirects
from kelastic.agent.events import MemorySink


def _impl(name: str, mp: Any, errors: Any, redirects: Any, tail_log: Any) -> SimpleNamespace:
    """One implementation's modules, under the same names."""
    return SimpleNamespace(
        name=name,
        mp=mp,
        errors=errors,
        redirects=redirects,
        TailLog=tail_log,
        SignalException=mp.SignalException,
    )


TORCH = _impl("torch", torch_mp, torch_errors, torch_redirects, torch_tail_log.TailLog)
KELASTIC = _impl("kelastic", k_mp, k_errors, k_redirects, k_mp.TailLog)
BOTH = pytest.mark.parametrize("impl", [TORCH, KELASTIC], ids=lambda i: i.name)


@pytest.fixture(autouse=True)
def _keep_signal_handlers() -> Iterator[None]:
    """torch's start() leaves its signal handlers installed; put every handler back."""
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
    saved = {s: signal.getsignal(s) for s in sigs}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _start(
    impl: SimpleNamespace, log_dir: Path, entrypoint: Any, args: dict[int, tuple[Any, ...]], **kw: Any
) -> Any:
    """torch 2.x's call, the same on both: logs_specs with a (possibly non-empty) log_dir."""
    specs = impl.mp.DefaultLogsSpecs(
        log_dir=str(log_dir),
        redirects=kw.pop("redirects", impl.mp.Std.NONE),
        tee=kw.pop("tee", impl.mp.Std.NONE),
    )
    envs = kw.pop("envs", {r: {"TORCHELASTIC_RUN_ID": "compat"} for r in args})
    return impl.mp.start_processes(
        name="trainer", entrypoint=entrypoint, args=args, envs=envs, logs_specs=specs, **kw
    )


def _wait(ctx: Any) -> Any:
    result = ctx.wait(timeout=60, period=0.05)
    assert result is not None
    return result


def _raise_value_error(text: str) -> None:
    raise ValueError(text)


# --- names ------------------------------------------------------------------------------------


def test_every_public_name_of_torchs_launcher_is_there() -> None:
    assert set(torch_mp.__all__) <= set(k_mp.__all__)
    assert set(torch_errors.__all__) <= set(dir(k_errors))
    assert {"redirect", "redirect_stdout", "redirect_stderr"} <= set(dir(k_mp.redirects))
    for name in (
        "TORCHELASTIC_TIMER_FILE",
        "TORCHELASTIC_HEALTH_CHECK_PORT",
        "TORCHELASTIC_ENABLE_FILE_TIMER",
    ):
        assert getattr(k_local_agent, name) == getattr(torch_local_agent, name)


@BOTH
def test_to_map(impl: SimpleNamespace) -> None:
    std = impl.mp.Std
    assert impl.mp.to_map(std.OUT, 2) == {0: std.OUT, 1: std.OUT}
    assert impl.mp.to_map({1: std.ERR}, 2) == {0: std.NONE, 1: std.ERR}
    assert k_mp.to_std_map is k_mp.to_map


# --- start_processes with torch's logging API ------------------------------------------------


@BOTH
def test_logs_specs_layout_in_a_non_empty_log_dir(impl: SimpleNamespace, tmp_path: Path) -> None:
    (tmp_path / "something-else.txt").write_text("the log dir is not empty")
    ctx = _start(
        impl,
        tmp_path,
        "/bin/sh",
        {0: ("-c", "echo out0"), 1: ("-c", "echo out1 >&2")},
        redirects=impl.mp.Std.ALL,
    )
    result = _wait(ctx)
    assert not result.is_failed() and result.return_values == {0: None, 1: None}
    rel = {r: str(Path(p).relative_to(tmp_path)) for r, p in result.stdouts.items()}
    assert all(re.fullmatch(rf"compat_\w+/attempt_0/{r}/stdout\.log", p) for r, p in rel.items()), rel
    assert Path(result.stdouts[0]).read_text() == "out0\n"
    assert Path(result.stderrs[1]).read_text() == "out1\n"
    # PContext's public maps, as torch's has them
    assert ctx.stdouts == result.stdouts and ctx.stderrs == result.stderrs
    assert {r: Path(p).name for r, p in ctx.error_files.items()} == {0: "error.json", 1: "error.json"}


@BOTH
def test_log_line_prefixes_and_duplicate_filters(
    impl: SimpleNamespace, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ctx = _start(
        impl,
        tmp_path,
        "/bin/sh",
        {0: ("-c", "echo keep-me; echo drop-me")},
        tee=impl.mp.Std.OUT,
        log_line_prefixes={0: "<r0> "},
        duplicate_stdout_filters=["keep"],
    )
    _wait(ctx)
    ctx.close()
    printed = capfd.readouterr().out
    assert "<r0> keep-me\n" in printed and "<r0> drop-me\n" in printed
    filtered = next(tmp_path.glob("compat_*/attempt_0/filtered_stdout.log"))
    assert filtered.read_text() == "<r0> keep-me\n"


@BOTH
def test_devnull_log_dir_discards_and_writes_no_error_file(impl: SimpleNamespace) -> None:
    specs = impl.mp.DefaultLogsSpecs(log_dir=os.devnull, redirects=impl.mp.Std.ALL)
    ctx = impl.mp.start_processes(
        "t", "/bin/sh", {0: ("-c", 'test -z "$TORCHELASTIC_ERROR_FILE"')}, {0: {}}, logs_specs=specs
    )
    result = _wait(ctx)
    assert not result.is_failed()


@BOTH
def test_a_file_as_log_dir_is_not_a_directory(impl: SimpleNamespace, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError):
        impl.mp.DefaultLogsSpecs(log_dir=str(tmp_path / "f"))


def test_kelastic_log_dir_errors_are_torchs_and_kelastics(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    for exc in (NotADirectoryError, ValueError):
        with pytest.raises(exc):
            k_mp.start_processes("t", "/bin/true", {0: ()}, {0: {}}, log_dir=tmp_path / "f")


@BOTH
def test_args_envs_mismatch_is_a_runtime_error(impl: SimpleNamespace, tmp_path: Path) -> None:
    specs = impl.mp.DefaultLogsSpecs(log_dir=str(tmp_path))
    with pytest.raises(RuntimeError):
        impl.mp.start_processes("t", "/bin/true", {0: (), 1: ()}, {0: {}}, logs_specs=specs)
    if impl is KELASTIC:  # and still the ValueError kelastic always raised
        with pytest.raises(ValueError):
            impl.mp.start_processes("t", "/bin/true", {0: (), 1: ()}, {0: {}}, logs_specs=specs)


@BOTH
def test_missing_binary_is_file_not_found(impl: SimpleNamespace, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        _start(impl, tmp_path, str(tmp_path / "no-such-binary"), {0: ()})


def test_both_kinds_of_log_arguments_at_once_are_refused(tmp_path: Path) -> None:
    specs = k_mp.DefaultLogsSpecs(log_dir=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="not both"):
        k_mp.start_processes("t", "/bin/true", {0: ()}, {0: {}}, log_dir=tmp_path / "b", logs_specs=specs)
    # a LogsSpecs in log_dir's place (torch's positional order) is taken as logs_specs
    result = _wait(k_mp.start_processes("t", "/bin/true", {0: ()}, {0: {}}, specs))
    assert not result.is_failed()


# --- results ---------------------------------------------------------------------------------


@BOTH
def test_ranks_stopped_after_a_failure_are_reported(impl: SimpleNamespace, tmp_path: Path) -> None:
    ctx = _start(impl, tmp_path, "/bin/sh", {0: ("-c", "sleep 0.3; exit 138"), 1: ("-c", "sleep 60")})
    result = _wait(ctx)
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: 138, 1: -15}
    # the root cause is the rank that failed, not the one stopped because of it
    assert min(result.failures.values(), key=lambda f: f.timestamp).local_rank == 0
    if impl is KELASTIC:
        assert result.root_failure().local_rank == 0


# Rank functions shared with test_mp_finish.py (forked ranks need no import by name).
helpers = SimpleNamespace(**runpy.run_path(str(Path(__file__).parent / "scripts" / "rank_helpers.py")))


@BOTH
def test_a_rank_that_returned_stays_alive_until_its_local_peers_returned(
    impl: SimpleNamespace, tmp_path: Path
) -> None:
    logs, go = tmp_path / "logs", tmp_path / "go"
    args = {0: (0, str(tmp_path / "returned0"), ""), 1: (1, str(tmp_path / "returned1"), str(go))}
    ctx = _start(impl, logs, helpers.return_when, args, start_method="fork")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "returned0").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        pid0 = int((tmp_path / "returned0").read_text())
        assert ctx.wait(timeout=1.0, period=0.05) is None  # rank 1 still runs
        assert helpers.alive(pid0), "rank 0 exited before its local peer returned"
        go.touch()
        result = _wait(ctx)
        assert not result.is_failed() and result.return_values == {0: 0, 1: 1}
        assert not helpers.alive(pid0)
    finally:
        ctx.close()


# The ranks fail together at a moment given in epoch seconds: each writes its error file
# (torch's layout) first, then at that moment exits with 3.
FAIL_AT = """\
import json, os, sys, time
rank = os.environ["LOCAL_RANK"]
text = f"RuntimeError: rank {rank} hit a bad batch"
data = {"message": {"message": text,
                    "extraInfo": {"py_callstack": "Traceback: ...\\n" + text, "timestamp": str(int(time.time()))}}}
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump(data, f)
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
os._exit(3)
"""


@BOTH
@pytest.mark.slow
def test_ranks_failing_at_once_are_each_reported(impl: SimpleNamespace, tmp_path: Path) -> None:
    # What a launcher sees of ranks ending together varies with when it looks: kelastic's is
    # tried several times (before its failure grace it reported -15 for one rank in about
    # half the runs); torch's once, as the reference (it holds both unless one of its looks,
    # a second apart, falls between the two exits, which heavy load makes more likely).
    for attempt in range(5 if impl is KELASTIC else 1):
        at = time.time() + 1.0
        args = {r: ("-c", FAIL_AT, at) for r in range(2)}
        envs = {r: {"TORCHELASTIC_RUN_ID": "compat", "LOCAL_RANK": str(r)} for r in range(2)}
        ctx = _start(impl, tmp_path / str(attempt), sys.executable, args, envs=envs)
        result = ctx.wait(timeout=60)  # torch's default period: how often its launcher looks
        assert result is not None
        assert {r: f.exitcode for r, f in result.failures.items()} == {0: 3, 1: 3}, attempt
        for rank, failure in result.failures.items():
            text = failure.message if isinstance(failure.message, str) else failure.message["message"]
            assert text == f"RuntimeError: rank {rank} hit a bad batch"
            assert failure.error_file == ctx.error_files[rank]
        error = impl.errors.ChildFailedError("trainer", result.failures)
        root, first = error.get_first_failure()
        assert first.timestamp == min(f.timestamp for f in result.failures.values())  # the earliest
        summary = str(error)
        assert "rank 0 hit a bad batch" in summary and "rank 1 hit a bad batch" in summary
        assert summary.index("Root Cause") < summary.index(f"rank {root} hit a bad batch")


def _fail_at(at: float) -> None:
    time.sleep(max(0.0, at - time.time()))
    raise RuntimeError(f"rank {os.environ['LOCAL_RANK']} hit a bad batch")


def test_callables_failing_at_once_are_each_reported(tmp_path: Path) -> None:
    """torch reports one failed callable; kelastic every one (kelastic.agent.multiprocessing.api)."""
    at = time.time() + 1.0
    envs = {r: {"TORCHELASTIC_RUN_ID": "compat", "LOCAL_RANK": str(r)} for r in range(2)}
    ctx = _start(KELASTIC, tmp_path, _fail_at, {0: (at,), 1: (at,)}, envs=envs, start_method="fork")
    result = _wait(ctx)
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: 1, 1: 1}
    assert {r: f.message for r, f in result.failures.items()} == {
        r: f"RuntimeError: rank {r} hit a bad batch" for r in range(2)
    }


# --- the contexts' constructors --------------------------------------------------------------


def _impl_contexts(impl: SimpleNamespace) -> tuple[Any, Any]:
    return impl.mp.MultiprocessContext, impl.mp.SubprocessContext


@BOTH
def test_contexts_take_torchs_constructor(impl: SimpleNamespace, tmp_path: Path) -> None:
    multi, sub = _impl_contexts(impl)
    envs = {r: {"TORCHELASTIC_RUN_ID": "compat"} for r in range(2)}
    specs = impl.mp.DefaultLogsSpecs(log_dir=str(tmp_path / "fn"), redirects=impl.mp.Std.ALL)
    ctx = multi(
        "trainer",
        helpers.return_when,
        {r: (r, str(tmp_path / f"m{r}"), "") for r in range(2)},
        envs,
        "fork",
        specs,
    )
    ctx.start()
    try:
        result = _wait(ctx)
        assert result.return_values == {0: 0, 1: 1}
    finally:
        ctx.close()
    specs = impl.mp.DefaultLogsSpecs(log_dir=str(tmp_path / "bin"), redirects=impl.mp.Std.OUT)
    ctx = sub(
        "trainer",
        "/bin/sh",
        {0: ("-c", "echo zero"), 1: ("-c", "echo one")},
        envs,
        logs_specs=specs,
        log_line_prefixes=None,
        duplicate_stdout_filters=["zero"],
    )
    ctx.start()
    try:
        result = _wait(ctx)
        assert not result.is_failed() and result.return_values == {0: None, 1: None}
        assert [Path(result.stdouts[r]).read_text() for r in range(2)] == ["zero\n", "one\n"]
    finally:
        ctx.close()


# --- error files -----------------------------------------------------------------------------


@BOTH
def test_error_file_layout_is_torchs(impl: SimpleNamespace, tmp_path: Path) -> None:
    ctx = _start(
        impl, tmp_path, _raise_value_error, {0: ("bad lr",)}, start_method="fork", redirects=impl.mp.Std.ALL
    )
    result = _wait(ctx)
    failure = result.failures[0]
    data = json.loads(Path(failure.error_file).read_text())
    assert set(data) == {"message"}
    assert data["message"]["message"] == "ValueError: bad lr"
    extra = data["message"]["extraInfo"]
    assert "_raise_value_error" in extra["py_callstack"] and int(extra["timestamp"]) > 0
    # torch's ProcessFailure reads the file (whichever launcher wrote it)
    read_by_torch = torch_errors.ProcessFailure(
        local_rank=0, pid=1, exitcode=1, error_file=failure.error_file
    )
    assert read_by_torch.message["message"] == "ValueError: bad lr"
    assert read_by_torch.timestamp == int(extra["timestamp"])
    # and kelastic's too
    read_by_kelastic = k_errors.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=failure.error_file)
    assert read_by_kelastic.message == "ValueError: bad lr"
    assert read_by_kelastic.timestamp == int(extra["timestamp"]) and isinstance(
        read_by_kelastic.timestamp, int
    )
    assert read_by_kelastic.error_file_data == data
    assert "_raise_value_error" in read_by_kelastic.traceback()


def test_the_old_flat_error_file_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "disk full", "traceback": "tb", "timestamp": 5.5}))
    failure = k_errors.ProcessFailure(local_rank=0, pid=1, exitcode=3, error_file=str(path))
    assert (failure.message, failure.timestamp, failure.failed_at, failure.traceback()) == (
        "disk full",
        5,
        5.5,
        "tb",
    )


@BOTH
@pytest.mark.parametrize("exitcode", [-9, 3])
def test_process_failure_without_error_file(impl: SimpleNamespace, exitcode: int, tmp_path: Path) -> None:
    failure = impl.errors.ProcessFailure(
        local_rank=0, pid=123, exitcode=exitcode, error_file=str(tmp_path / "none.json")
    )
    assert failure.error_file == "<N/A>"
    assert failure.error_file_data["message"] == "<NONE>"
    assert isinstance(failure.timestamp, int) and abs(failure.timestamp - time.time()) < 60
    if exitcode < 0:
        assert failure.signal_name() == "SIGKILL"
        assert failure.message == "Signal 9 (SIGKILL) received by PID 123"
    else:
        assert failure.signal_name() == "<N/A>"
        # the exit code and pid are fields already: the message points at @record
        assert (
            failure.message == "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
        )
        assert failure.error_file_data["errorTraits"] == {
            "category": "system_terminated_error",
            "retryability": "False",
        }
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d:\d\d:\d\d", failure.timestamp_isoformat())


@BOTH
@pytest.mark.parametrize(
    ("content", "error"),
    [("{not json", ValueError), ('{"other": 1}', KeyError), ('{"message": {"extraInfo": {}}}', KeyError)],
    ids=["not-json", "no-message", "no-timestamp"],
)
def test_a_malformed_error_file_raises(
    impl: SimpleNamespace, content: str, error: type[Exception], tmp_path: Path
) -> None:
    path = tmp_path / "error.json"
    path.write_text(content)
    with pytest.raises(error):
        impl.errors.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))


def _write_bad_error_file_and_fail() -> None:
    Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text('{"written": "by a handler of its own"}')
    os._exit(3)


@BOTH
def test_the_launcher_and_a_rank_whose_error_file_is_malformed(impl: SimpleNamespace, tmp_path: Path) -> None:
    ctx = _start(impl, tmp_path, _write_bad_error_file_and_fail, {0: ()}, start_method="fork")
    try:
        if impl is TORCH:  # torch's wait raises ProcessFailure's error: the run's outcome is lost
            with pytest.raises(KeyError):
                ctx.wait(timeout=60, period=0.05)
            return
        # kelastic reports the failure (module docstring of kelastic.agent.multiprocessing.api)
        failure = _wait(ctx).failures[0]
        assert failure.exitcode == 3 and failure.error_file == ctx.error_files[0]
        assert "could not be read" in failure.message and ctx.error_files[0] in failure.message
    finally:
        ctx.close()


@BOTH
def test_record_returns_on_system_exit_zero(
    impl: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))

    @impl.errors.record
    def done() -> None:
        sys.exit(0)

    @impl.errors.record
    def failed() -> None:
        sys.exit(3)

    assert done() is None
    with pytest.raises(SystemExit):
        failed()
    assert not (tmp_path / "error.json").exists()  # an intentional exit is not an error


@BOTH
def test_error_handler_writes_what_the_other_reads(
    impl: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    handler = impl.errors.get_error_handler()
    assert isinstance(handler, impl.errors.ErrorHandler)
    handler.initialize()
    try:
        raise KeyError("missing shard")
    except KeyError as e:
        handler.record_exception(e)
    other = KELASTIC if impl is TORCH else TORCH
    failure = other.errors.ProcessFailure(
        local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "error.json")
    )
    text = failure.message if isinstance(failure.message, str) else failure.message["message"]
    assert text == "KeyError: 'missing shard'"


@BOTH
def test_child_failed_error_copies_the_childs_error_file(
    impl: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    child_file = tmp_path / "child.json"
    child_file.write_text(
        json.dumps({"message": {"message": "OOM", "extraInfo": {"py_callstack": "tb", "timestamp": "100"}}})
    )
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "parent.json"))
    failures = {
        3: impl.errors.ProcessFailure(local_rank=1, pid=7, exitcode=-9, error_file=str(child_file)),
    }

    @impl.errors.record
    def launcher() -> None:
        raise impl.errors.ChildFailedError("trainer", failures)

    with pytest.raises(impl.errors.ChildFailedError) as caught:
        launcher()
    assert caught.value.get_first_failure() == (3, failures[3])
    assert "trainer FAILED" in str(caught.value)
    parent = json.loads((tmp_path / "parent.json").read_text())
    assert parent["message"]["message"] == "OOM" and parent["message"]["errorCode"] == -9


@BOTH
def test_child_failed_error_without_a_child_error_file_writes_none(
    impl: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "parent.json"))
    failure = impl.errors.ProcessFailure(
        local_rank=0, pid=7, exitcode=1, error_file=str(tmp_path / "none.json")
    )

    @impl.errors.record
    def launcher() -> None:
        raise impl.errors.ChildFailedError("trainer", {0: failure})

    with pytest.raises(impl.errors.ChildFailedError):
        launcher()
    # the launcher's own error file would name the launcher, not the child, as the culprit
    assert not (tmp_path / "parent.json").exists()


# --- signals, tailing, redirects -------------------------------------------------------------


@BOTH
def test_signals_to_handle_come_from_the_environment(
    impl: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR1")
    ctx = _start(impl, tmp_path, "/bin/sh", {0: ("-c", "sleep 60")})
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(impl.SignalException) as caught:
            ctx.wait(timeout=30, period=0.05)
        assert caught.value.sigval == signal.SIGUSR1
    finally:
        ctx.close()


@BOTH
def test_tail_log_line_filter(impl: SimpleNamespace, tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    log.write_text("keep 1\ndrop 2\nkeep 3\n")
    dst = io.StringIO()
    tail = impl.TailLog(
        "w", {0: str(log)}, dst, None, 0.01, log_line_filter=lambda line: "keep" in line
    ).start()
    time.sleep(0.3)  # torch's tailer has no drain on stop: let it read the file first
    tail.stop()
    assert dst.getvalue() == "[w0]:keep 1\n[w0]:keep 3\n"


@BOTH
def test_redirect_stdout_at_the_fd_level(
    impl: SimpleNamespace, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "out.txt"
    fd = sys.stdout.fileno()  # fd 1 outside pytest's capture
    with impl.redirects.redirect_stdout(str(target)):
        os.write(fd, b"from the fd\n")
        print("from print", flush=True)
    print("after", flush=True)
    assert target.read_text() == "from the fd\nfrom print\n"
    assert capfd.readouterr().out == "after\n"


# --- WorkerSpec and the agents ---------------------------------------------------------------


def _entry() -> None:
    pass


def test_worker_spec_has_torchs_fields() -> None:
    torch_fields = {f.name for f in dataclasses.fields(torch_agent_api.WorkerSpec)}
    assert torch_fields <= {f.name for f in dataclasses.fields(k_agent_api.WorkerSpec)}
    spec = k_agent_api.WorkerSpec(
        role="w",
        local_world_size=2,
        rdzv_handler=None,
        entrypoint="/bin/true",
        event_log_handler="console",
        virtual_local_rank=True,
        duplicate_stdout_filters=["loss"],
        duplicate_stderr_filters=["warn"],
    )
    assert spec.rdzv_handler is None and spec.virtual_local_rank


@pytest.mark.parametrize("module", [torch_agent_api, k_agent_api], ids=["torch", "kelastic"])
def test_worker_spec_fn_is_a_deprecated_entrypoint(module: Any) -> None:
    with pytest.warns(DeprecationWarning, match="entrypoint"):
        spec = module.WorkerSpec(role="w", local_world_size=1, rdzv_handler=None, fn=_entry)
    assert spec.entrypoint is _entry and spec.get_entrypoint_name() == "_entry"


def test_an_agent_needs_a_rendezvous_handler() -> None:
    spec = k_agent_api.WorkerSpec(role="w", local_world_size=1, rdzv_handler=None, entrypoint="/bin/true")
    with pytest.raises(ValueError, match="rdzv_handler"):
        k_local_agent.LocalElasticAgent(spec, progress=False)


def test_virtual_local_rank_env() -> None:
    spec = k_agent_api.WorkerSpec(
        role="w", local_world_size=2, rdzv_handler=None, entrypoint="/bin/true", virtual_local_rank=True
    )
    group = k_agent_api.WorkerGroup(spec)
    env = k_local_agent.worker_env(
        spec,
        group,
        1,
        restart_count=0,
        run_id="r",
        use_agent_store=False,
        progress_file="p",
        base_env={"CUDA_VISIBLE_DEVICES": "4,6"},
    )
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) == ("0", "6")


def test_the_local_env_is_the_group_independent_part_of_the_worker_env() -> None:
    spec = k_agent_api.WorkerSpec(role="w", local_world_size=2, rdzv_handler=None, entrypoint="/bin/true")
    group = k_agent_api.WorkerGroup(spec)
    kwargs: dict[str, Any] = {"run_id": "r", "progress_file": "p", "base_env": {}}
    local = k_local_agent.local_env(spec, 1, **kwargs)
    full = k_local_agent.worker_env(spec, group, 1, restart_count=3, use_agent_store=False, **kwargs)
    assert local.items() <= full.items()
    assert local["LOCAL_RANK"] == "1" and local["LOCAL_WORLD_SIZE"] == "2"
    # what a worker started before its group (a standby's) cannot know yet
    assert (
        not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"} & local.keys()
    )
    assert full["TORCHELASTIC_RESTART_COUNT"] == "3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _static_spec(module: Any, run_id: str, entrypoint: Any, args: tuple[Any, ...]) -> Any:
    handler = StaticTCPRendezvous("127.0.0.1", _free_port(), rank=0, world_size=1, run_id=run_id, timeout=30)
    return module.WorkerSpec(
        role="trainer",
        local_world_size=2,
        rdzv_handler=handler,
        entrypoint=entrypoint,
        args=args,
        max_restarts=0,
        monitor_interval=0.1,
    )


@pytest.mark.parametrize(
    ("module", "agent_module", "logs_mod"),
    [(torch_agent_api, torch_local_agent, torch_mp), (k_agent_api, k_local_agent, k_mp)],
    ids=["torch", "kelastic"],
)
def test_local_agent_with_logs_specs_and_prefix_template(
    module: Any, agent_module: Any, logs_mod: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    spec = _static_spec(module, "compat", "/bin/sh", ("-c", "echo hello from $RANK"))
    specs = logs_mod.DefaultLogsSpecs(log_dir=str(tmp_path), tee=logs_mod.Std.OUT)
    agent = agent_module.LocalElasticAgent(spec, specs, "spawn", 30, "[${role_name}-${rank}]:")
    result = agent.run()
    assert not result.is_failed()
    printed = capfd.readouterr().out
    assert "[trainer-0]:hello from 0" in printed and "[trainer-1]:hello from 1" in printed
    logs = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/attempt_*/*/stdout.log"))
    assert [re.sub(r"^compat_\w+", "compat_X", p) for p in logs] == [
        "compat_X/attempt_0/0/stdout.log",
        "compat_X/attempt_0/1/stdout.log",
    ]


def test_get_event_succeeded_and_failed(tmp_path: Path) -> None:
    spec = _static_spec(k_agent_api, "events", "/bin/true", ())
    agent = k_local_agent.LocalElasticAgent(spec, log_dir=tmp_path, event_sink=MemorySink(), progress=False)
    ok = agent.get_event_succeeded()
    assert (
        ok.source.value == "AGENT"
        and ok.metadata["state"] == "SUCCEEDED"
        and ok.metadata["raw_error"] is None
    )
    try:
        raise RuntimeError("agent broke")
    except RuntimeError:
        failed = agent.get_event_failed()
    assert failed.metadata["state"] == "FAILED"
    assert "RuntimeError: agent broke" in str(failed.metadata["raw_error"])
    assert failed.metadata["run_id"] == "events" and failed.metadata["entry_point"] == "true"


# --- the exit barrier ------------------------------------------------------------------------


def _c10d_handler(run_id: str) -> Any:
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{_free_port()}",
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
        is_host=True,
    )
    return rdzv_registry.get_rendezvous_handler(params)


def _static_handler(run_id: str) -> Any:
    return StaticTCPRendezvous("127.0.0.1", _free_port(), rank=0, world_size=1, run_id=run_id, timeout=30)


class _FinishingStatic(StaticTCPRendezvous):
    """torch's static rendezvous that runs its own exit barrier, as kelastic's handler does."""

    calls = 0

    def wait_all_finished(self, timeout: float) -> bool:
        type(self).calls += 1
        return True


def _run_one_worker(module: Any, agent_module: Any, logs_mod: Any, handler: Any, tmp_path: Path) -> Any:
    spec = module.WorkerSpec(
        role="w",
        local_world_size=1,
        rdzv_handler=handler,
        entrypoint="/bin/true",
        max_restarts=0,
        monitor_interval=0.05,
    )
    agent = agent_module.LocalElasticAgent(
        spec, logs_mod.DefaultLogsSpecs(log_dir=str(tmp_path)), "spawn", 30
    )
    return agent.run()


@pytest.mark.parametrize("make_handler", [_c10d_handler, _static_handler], ids=["c10d", "static"])
@pytest.mark.parametrize(
    ("module", "agent_module", "logs_mod"),
    [(torch_agent_api, torch_local_agent, torch_mp), (k_agent_api, k_local_agent, k_mp)],
    ids=["torch", "kelastic"],
)
def test_torchs_handlers_get_torchs_exit_barrier(
    module: Any, agent_module: Any, logs_mod: Any, make_handler: Any, tmp_path: Path
) -> None:
    handler = make_handler("barrier")
    with mock.patch("torch.distributed.elastic.utils.store.barrier") as barrier:
        barrier.side_effect = RuntimeError("test error")
        result = _run_one_worker(module, agent_module, logs_mod, handler, tmp_path)
    handler.shutdown()
    assert not result.is_failed()  # a failed exit barrier does not fail a finished job
    barrier.assert_called_once()
    assert barrier.call_args.kwargs["world_size"] == 1 and barrier.call_args.kwargs["barrier_timeout"] == 30


def test_a_handler_with_its_own_exit_barrier_keeps_it(tmp_path: Path) -> None:
    handler = _FinishingStatic("127.0.0.1", _free_port(), rank=0, world_size=1, run_id="own", timeout=30)
    with mock.patch("torch.distributed.elastic.utils.store.barrier") as barrier:
        result = _run_one_worker(k_agent_api, k_local_agent, k_mp, handler, tmp_path)
    assert not result.is_failed()
    barrier.assert_not_called()
    assert _FinishingStatic.calls == 1
