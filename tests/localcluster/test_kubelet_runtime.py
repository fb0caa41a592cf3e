"""Container processes: logs, exit codes, process-group kills (grandchildren too)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from kelastic.localcluster.kubelet.runtime import spawn
from kelastic.localcluster.testing import process_alive


def _wait_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written within {timeout}s")


def test_output_and_exit_code(tmp_path: Path) -> None:
    async def main() -> None:
        log = tmp_path / "c" / "0.log"
        proc = spawn(
            [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
            dict(os.environ),
            str(tmp_path),
            log,
        )
        status = await asyncio.wait_for(proc.wait(), 20)
        assert status.exit_code == 3 and status.signal is None
        assert sorted(log.read_text().split()) == ["err", "out"]

    asyncio.run(main())


GRANDPARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def test_stop_kills_the_whole_group_and_reports_the_signal(tmp_path: Path) -> None:
    async def main() -> None:
        pidfile = tmp_path / "grandchild.pid"
        proc = spawn(
            [sys.executable, "-c", GRANDPARENT, str(pidfile)],
            dict(os.environ),
            str(tmp_path),
            tmp_path / "0.log",
        )
        grandchild = int(await asyncio.to_thread(_wait_file, pidfile))
        assert process_alive(grandchild)
        status = await asyncio.wait_for(proc.stop(grace=5.0), 20)
        assert status.exit_code == 128 + signal.SIGTERM and status.signal == signal.SIGTERM
        deadline = time.monotonic() + 5
        while process_alive(grandchild) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not process_alive(grandchild)

    asyncio.run(main())


def test_leftovers_die_with_the_main_process(tmp_path: Path) -> None:
    script = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
"""

    async def main() -> None:
        pidfile = tmp_path / "left.pid"
        proc = spawn(
            [sys.executable, "-c", script, str(pidfile)], dict(os.environ), str(tmp_path), tmp_path / "0.log"
        )
        status = await asyncio.wait_for(proc.wait(), 20)
        assert status.exit_code == 0
        left = int(pidfile.read_text())
        deadline = time.monotonic() + 5
        while process_alive(left) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not process_alive(left)

    asyncio.run(main())


def test_sigterm_ignored_means_sigkill_after_grace(tmp_path: Path) -> None:
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"

    async def main() -> None:
        log = tmp_path / "0.log"
        proc = spawn([sys.executable, "-c", script], dict(os.environ), str(tmp_path), log)
        await asyncio.to_thread(_wait_file, log)
        start = time.monotonic()
        status = await asyncio.wait_for(proc.stop(grace=1.0), 20)
        assert status.exit_code == 137 and time.monotonic() - start >= 0.9

    asyncio.run(main())


def test_the_whole_tree_dies_with_the_thread_that_started_it(tmp_path: Path) -> None:
    started: dict[str, int] = {}
    pidfile = tmp_path / "grandchild.pid"

    def node_thread() -> None:
        async def main() -> None:
            proc = spawn(
                [sys.executable, "-c", GRANDPARENT, str(pidfile)],
                dict(os.environ),
                str(tmp_path),
                tmp_path / "0.log",
            )
            started["pid"] = proc.pid
            await asyncio.to_thread(_wait_file, pidfile)

        asyncio.run(main())

    thread = threading.Thread(target=node_thread)
    thread.start()
    thread.join(20)
    leader, grandchild = started["pid"], int(pidfile.read_text())
    try:
        deadline = time.monotonic() + 5
        while (process_alive(leader) or process_alive(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(leader) and not process_alive(grandchild), (
            "container processes outlived the kubelet thread"
        )
    finally:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(leader, 0)


def test_unknown_executables_fail_before_starting(tmp_path: Path) -> None:
    async def main() -> None:
        with pytest.raises(FileNotFoundError, match="kelastic-no-such-binary"):
            spawn(["kelastic-no-such-binary"], dict(os.environ), str(tmp_path), tmp_path / "0.log")
        with pytest.raises(PermissionError):
            spawn([str(tmp_path)], dict(os.environ), str(tmp_path), tmp_path / "0.log")

    asyncio.run(main())


def test_probes_against_real_processes_and_sockets(tmp_path: Path) -> None:
    import http.server

    from kelastic.localcluster.kubelet.probes import ProbeKind, ProbeResult, ProbeSpec, run_probe

    (tmp_path / "healthz").write_text("ok")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]

    def probe(kind: ProbeKind, handler: dict, timeout: float = 2.0) -> ProbeResult:
        spec = ProbeSpec(kind=kind, handler=handler, timeout=timeout)
        return asyncio.run(run_probe(spec, pod_ip="127.0.0.1", env=dict(os.environ), cwd=str(tmp_path)))

    try:
        ok, bad = ProbeResult.SUCCESS, ProbeResult.FAILURE
        assert probe(ProbeKind.EXEC, {"command": ["python3", "-c", "import sys; sys.exit(0)"]}) is ok
        assert probe(ProbeKind.EXEC, {"command": ["python", "-c", "import sys; sys.exit(1)"]}) is bad
        start = time.monotonic()
        assert probe(ProbeKind.EXEC, {"command": ["sleep", "30"]}, timeout=0.3) is bad
        assert time.monotonic() - start < 5  # killed at its timeout
        assert probe(ProbeKind.HTTP_GET, {"path": "/healthz", "port": port}) is ok
        assert probe(ProbeKind.HTTP_GET, {"path": "/missing", "port": port}) is bad
        assert probe(ProbeKind.TCP_SOCKET, {"port": port}) is ok
    finally:
        server.shutdown()
        server.server_close()
    assert probe(ProbeKind.TCP_SOCKET, {"port": port}) is bad
