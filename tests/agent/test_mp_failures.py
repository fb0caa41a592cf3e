"""``RunProcsResult.failures`` holds the ranks that failed: torch's ``test_function_raise`` and
``test_function_exit``, run against torch's ``start_processes`` (the reference) and kelastic's.

Callable rank 0 raises (or exits 138) while rank 1 has already returned and waits for the
finish handshake: the launcher stops rank 1, and torch reports ``failures={0}`` only; so
does kelastic. A binary rank the launcher stopped because another failed is reported with
the signal that stopped it, as torch does (``test_torch_api_compat``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch.distributed.elastic.multiprocessing as torch_mp

import kelastic.agent.multiprocessing as k_mp

SCRIPTS = Path(__file__).parent / "scripts"
TORCH = SimpleNamespace(name="torch", mp=torch_mp)
KELASTIC = SimpleNamespace(name="kelastic", mp=k_mp)
#: torch's launcher looks at its ranks once a second: its runs are the slow ones.
BOTH = pytest.mark.parametrize(
    "impl", [pytest.param(TORCH, marks=pytest.mark.slow), KELASTIC], ids=lambda i: i.name
)
METHODS = pytest.mark.parametrize("method", ["fork", "spawn"])
FAIL = 138


@pytest.fixture
def helpers(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``rank_helpers`` imported by name, so that spawned ranks find its functions."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import rank_helpers

    return rank_helpers


@pytest.fixture(autouse=True)
def _keep_signal_handlers() -> Iterator[None]:
    """Both launchers install signal handlers in start(); put every handler back."""
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    saved = {s: signal.getsignal(s) for s in sigs}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _gone(pids: dict[int, int]) -> bool:
    for pid in pids.values():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def _run(impl: SimpleNamespace, tmp_path: Path, fn: Any, args: dict[int, tuple[Any, ...]], **kw: Any) -> Any:
    specs = impl.mp.DefaultLogsSpecs(log_dir=str(tmp_path), redirects=kw.pop("redirects", impl.mp.Std.NONE))
    ctx = impl.mp.start_processes(
        name="echo",
        entrypoint=fn,
        args=args,
        envs={0: {"RANK": "0"}, 1: {"RANK": "1"}},
        logs_specs=specs,
        **kw,
    )
    try:
        result = ctx.wait(timeout=120, period=0.1)
    finally:
        ctx.close()
    assert result is not None, "the ranks did not finish"
    return ctx, result


@BOTH
@METHODS
def test_function_raise(impl: SimpleNamespace, method: str, tmp_path: Path, helpers: ModuleType) -> None:
    """Rank 0 raises, rank 1 returned: one failure, rank 0's, with its error file; no values."""
    ctx, result = _run(
        impl, tmp_path, helpers.echo_or_raise, {0: ("hello", True), 1: ("world",)}, start_method=method
    )
    assert _gone(ctx.pids())
    assert list(result.failures) == [0], {r: f.exitcode for r, f in result.failures.items()}
    assert not result.return_values
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert failure.signal_name() == "<N/A>"
    assert failure.pid == ctx.pids()[0]
    assert failure.error_file == ctx.error_files[0]
    assert int(failure.error_file_data["message"]["extraInfo"]["timestamp"]) == int(failure.timestamp)


@BOTH
@METHODS
def test_function_exit(impl: SimpleNamespace, method: str, tmp_path: Path, helpers: ModuleType) -> None:
    """Rank 0 exits 138, rank 1 returned: one failure, rank 0's, its stderr in its log."""
    ctx, result = _run(
        impl,
        tmp_path,
        helpers.echo_or_exit,
        {0: ("hello", FAIL), 1: ("hello",)},
        start_method=method,
        redirects={0: impl.mp.Std.ERR},
    )
    assert _gone(ctx.pids())
    assert result.is_failed()
    assert list(result.failures) == [0], {r: f.exitcode for r, f in result.failures.items()}
    assert not result.return_values
    failure = result.failures[0]
    assert failure.exitcode == FAIL
    assert failure.signal_name() == "<N/A>"
    assert failure.pid == ctx.pids()[0]
    # torch 2.x's message for a rank that left no error file (older releases said the exit code)
    assert failure.message == "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    assert failure.timestamp <= int(time.time())
    assert f"exit {FAIL} from 0\n" in Path(result.stderrs[0]).read_text()
    assert not result.stdouts[0] and not result.stderrs[1] and not result.stdouts[1]


def test_a_callable_the_launcher_stopped_is_not_a_failure(tmp_path: Path, helpers: ModuleType) -> None:
    """As torch's: rank 1, still running when rank 0 failed, is stopped and not reported
    (it did not fail); the failure that stopped it is the only one."""
    _, result = _run(
        KELASTIC, tmp_path, helpers.echo_or_exit, {0: ("hello", FAIL), 1: ("hello",)}, start_method="fork"
    )
    assert list(result.failures) == [0]
    _, result = _run(
        KELASTIC,
        tmp_path / "sleeping",
        time.sleep,
        {0: (-1,), 1: (60,)},  # time.sleep(-1) raises ValueError
        start_method="fork",
    )
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: 1}


def test_a_binary_the_launcher_stopped_is_reported_with_its_signal(tmp_path: Path) -> None:
    """As torch's: a binary rank stopped because another failed carries the signal (-15);
    one that had exited 0 before is no failure."""
    ctx = k_mp.start_processes(
        name="sh",
        entrypoint="/bin/sh",
        args={0: ("-c", "sleep 0.5; exit 3"), 1: ("-c", "sleep 60"), 2: ("-c", "exit 0")},
        envs={r: {} for r in range(3)},
        logs_specs=k_mp.DefaultLogsSpecs(log_dir=str(tmp_path)),
    )
    try:
        result = ctx.wait(timeout=120, period=0.1)
    finally:
        ctx.close()
    assert result is not None
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: 3, 1: -signal.SIGTERM}
    assert result.root_failure().local_rank == 0
