"""Runs real ``python -m kelastic.agent`` processes for the agent's end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).parent / "scripts" / "check_worker.py"


@dataclass
class AgentProc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.name} still running after {timeout}s; its output:\n{self.output()[-4000:]}"
            ) from None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class Cluster:
    """Agents of one job sharing an output directory and the job's secret (``secret``, a
    0600 file every agent gets with ``--job-secret-file``); ``close()`` kills whatever is left."""

    def __init__(self, tmp: Path, endpoint: str = "", run_id: str = "job") -> None:
        self.tmp = tmp
        self.out = tmp / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.secret = tmp / "job-secret"
        if not self.secret.exists():
            self.secret.write_text(secrets.token_hex(32) + "\n")
            self.secret.chmod(0o600)
        self.logs = tmp / "logs"
        self.endpoint = endpoint
        self.run_id = run_id
        self.agents: list[AgentProc] = []

    def start(
        self,
        name: str,
        agent_args: list[str],
        script_args: list[str] = (),  # type: ignore[assignment]
        *,
        rendezvous: bool = True,
        env: dict[str, str] | None = None,
        script: Path | None = None,
    ) -> AgentProc:
        rdzv = (
            ["--rdzv-backend", "kelastic", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id]
            if rendezvous
            else []
        )
        cmd = [
            sys.executable, "-m", "kelastic.agent", *rdzv, "--local-addr", "127.0.0.1",
            "--job-secret-file", str(self.secret), "--log-dir", str(self.logs / name), *agent_args,
            str(script or SCRIPT), "--out", str(self.out), *script_args,
        ]  # fmt: skip
        extra = env or {}
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("PET_")}
        env.update({"KELASTIC_NODE_NAME": name, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO", **extra})
        log = self.tmp / f"{name}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        agent = AgentProc(name, proc, log)
        self.agents.append(agent)
        return agent

    def records(self, world: int | None = None) -> list[dict[str, Any]]:
        pattern = f"w{world}_*.json" if world is not None else "w*.json"
        return [json.loads(p.read_text()) for p in sorted(self.out.glob(pattern))]

    def steps(self) -> list[tuple[float, int, int, int]]:
        path = self.out / "steps.log"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                rows.append((float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3])))
        return rows

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {a.name}:\n{a.output()[-2500:]}" for a in self.agents)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")

    def wait_all(self, timeout: float, agents: list[AgentProc] | None = None) -> list[int]:
        deadline = time.monotonic() + timeout
        return [a.wait(max(0.1, deadline - time.monotonic())) for a in (agents or self.agents)]

    def close(self) -> None:
        for a in self.agents:
            if a.proc.poll() is None:
                a.kill_group(signal.SIGKILL)
        for a in self.agents:
            try:
                a.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def loopback_host() -> str:
    """A random 127.x address, so concurrent test runs do not share a store port."""
    return f"127.{random.randint(64, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"


def events(out: Path) -> list[dict[str, Any]]:
    """The events the agents' workers wrote to ``out/events.jsonl`` (scripts/check_worker.py), oldest first."""
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
