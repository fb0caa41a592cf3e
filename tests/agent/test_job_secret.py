"""The job's secret: reading and checking the file, the decision whether an agent may start
without one, the ephemeral key of a single-node run, and the flag's errors as a user sees
them (a real ``python -m kelastic.agent`` process: exit 2, one line naming flag and file)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kelastic.agent import secret
from kelastic.agent.cli import build_parser, config_from_args, resolve_job_secret
from kelastic.agent.contract import (
    ENV_INSECURE_NO_SECRET,
    ENV_JOB_SECRET_FILE,
    FLAG_INSECURE_NO_SECRET,
    FLAG_JOB_SECRET_FILE,
)
from kelastic.agent.secret import SecretError, SecretSource


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_secret_file_is_its_stripped_bytes(tmp_path: Path) -> None:
    key = "ab" * 32
    assert secret.read_secret_file(write(tmp_path / "s", f"  {key}\n")) == key.encode()


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (lambda d: d / "missing", "no such file"),
        (lambda d: d, "is a directory"),
        (lambda d: write(d / "short", "abc\n"), "holds 3 bytes; a job secret has at least 32"),
        (lambda d: write(d / "big", "x" * 5000), "over 4096 bytes"),
        (lambda d: write(d / "blank", "   \n\n"), "holds 0 bytes"),
    ],
)
def test_an_unusable_secret_file_names_the_flag_and_the_file(tmp_path: Path, setup, needle: str) -> None:  # type: ignore[no-untyped-def]
    path = setup(tmp_path)
    with pytest.raises(SecretError) as info:
        secret.read_secret_file(path)
    message = str(info.value)
    assert needle in message and FLAG_JOB_SECRET_FILE in message and str(path) in message, message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file; the permission check needs another user")
def test_an_unreadable_secret_file_says_so(tmp_path: Path) -> None:
    path = write(tmp_path / "s", "ab" * 32)
    path.chmod(0)
    with pytest.raises(SecretError, match="permission denied"):
        secret.read_secret_file(path)


def test_the_decision() -> None:
    d = secret.decide
    assert (
        d(secret_file="f", insecure=True, serves=True, listen="10.0.0.1", max_nodes=4).source
        is SecretSource.FILE
    )
    assert d(secret_file=None, insecure=True, serves=True, listen="10.0.0.1", max_nodes=4).source is (
        SecretSource.INSECURE
    )
    assert d(secret_file=None, insecure=False, serves=False, listen="10.0.0.1", max_nodes=4).source is None
    alone = d(secret_file=None, insecure=False, serves=True, listen="127.0.0.1", max_nodes=1)
    assert alone.source is SecretSource.EPHEMERAL and alone.refusal is None
    beyond = d(secret_file=None, insecure=False, serves=True, listen="0.0.0.0", max_nodes=1)
    assert beyond.source is None and beyond.refusal is not None
    assert "beyond loopback" in beyond.refusal and FLAG_JOB_SECRET_FILE in beyond.refusal
    assert FLAG_INSECURE_NO_SECRET in beyond.refusal
    several = d(secret_file=None, insecure=False, serves=True, listen="127.1.2.3", max_nodes=3)
    assert (
        several.refusal is not None and "3 nodes" in several.refusal and "share one secret" in several.refusal
    )


def test_loopback_addresses() -> None:
    assert secret.is_loopback("127.0.0.1") and secret.is_loopback("127.1.9.9") and secret.is_loopback("::1")
    assert secret.is_loopback("[::1]") and secret.is_loopback("localhost")
    assert not secret.is_loopback("0.0.0.0") and not secret.is_loopback("10.1.2.3")
    assert not secret.is_loopback("no-such-host.invalid")


def test_an_ephemeral_secret_is_private_and_goes_with_its_agent() -> None:
    key = secret.ephemeral_secret()
    assert key.path is not None and key.owned is not None
    assert stat.S_IMODE(os.stat(key.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(key.owned).st_mode) == 0o700
    assert secret.read_secret_file(key.path) == key.key and len(key.key) == 64
    assert key.worker_env() == {ENV_JOB_SECRET_FILE: key.path}
    assert key.key.decode() not in repr(key)
    key.discard()
    assert not os.path.exists(key.owned)


def test_workers_read_the_path_they_are_given(tmp_path: Path) -> None:
    path = write(tmp_path / "s", "cd" * 32)
    got = secret.secret_from_env({ENV_JOB_SECRET_FILE: str(path)})
    assert got.key == b"cd" * 32 and got.source is SecretSource.FILE
    assert secret.secret_from_env({ENV_INSECURE_NO_SECRET: "1"}).key == secret.INSECURE_KEY
    with pytest.raises(SecretError, match=ENV_JOB_SECRET_FILE):
        secret.secret_from_env({})


def config(*argv: str):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args([*argv, "train.py"]))


def test_what_each_kind_of_agent_gets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_JOB_SECRET_FILE, raising=False)
    monkeypatch.delenv(ENV_INSECURE_NO_SECRET, raising=False)
    standalone = resolve_job_secret(config("--standalone"))
    assert standalone is not None and standalone.source is SecretSource.EPHEMERAL
    standalone.discard()
    with pytest.raises(SecretError, match="beyond loopback"):
        resolve_job_secret(
            config("--nnodes", "2", "--rdzv-endpoint", "10.9.8.7:29400", "--local-addr", "10.9.8.7")
        )
    with pytest.raises(SecretError, match="share one secret"):
        resolve_job_secret(config("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"))
    insecure = resolve_job_secret(
        config("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", FLAG_INSECURE_NO_SECRET)
    )
    assert insecure is not None and insecure.source is SecretSource.INSECURE
    path = write(tmp_path / "s", "ef" * 32)
    given = resolve_job_secret(
        config("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", FLAG_JOB_SECRET_FILE, str(path))
    )
    assert given is not None and given.key == b"ef" * 32 and given.path == str(path)
    # torch's backend and no checkpoint service: nothing of kelastic listens, no secret needed
    bare = config("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400",
                  "--checkpoint-memory", "0")  # fmt: skip
    assert resolve_job_secret(bare) is None


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ([FLAG_JOB_SECRET_FILE, "/nonexistent/kelastic/job-secret"], "no such file"),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"], "share one secret"),
    ],
)
def test_the_agent_refuses_to_start_without_a_usable_secret(
    flags: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user sees it: exit status 2 and one line naming the flag, before anything starts."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_JOB_SECRET_FILE, ENV_INSECURE_NO_SECRET)}
    done = subprocess.run(
        [sys.executable, "-m", "kelastic.agent", *flags, "train.py"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and FLAG_JOB_SECRET_FILE in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def run_standalone(
    tmp_path: Path, *flags: str, level: str = "INFO"
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """A single-node agent saving three checkpoints with MemoryWriter; its output (logged at
    ``level``) and events."""
    script = Path(__file__).parent / "scripts" / "ckpt_worker.py"
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (ENV_JOB_SECRET_FILE, ENV_INSECURE_NO_SECRET)}
    done = subprocess.run(
        [sys.executable, "-m", "kelastic.agent", "--standalone", "--nproc-per-node", "1", *flags,
         "--checkpoint-dir", str(tmp_path / "shm"), "--checkpoint-memory", "64Mi",
         str(script), "--out", str(out), "--steps", "3", "--step-time", "0", "--mib", "1"],
        capture_output=True, text=True, timeout=240, env={**env, "LOGLEVEL": level},
    )  # fmt: skip
    events = (out / "events.jsonl").read_text().splitlines() if (out / "events.jsonl").exists() else []
    return done, events


@pytest.mark.slow
def test_a_single_node_run_on_loopback_uses_a_key_of_its_own_and_removes_it(tmp_path: Path) -> None:
    # The key's path is a detail the agent names at DEBUG.
    done, events = run_standalone(tmp_path, level="DEBUG")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sum('"saved"' in e for e in events) == 3, events
    found = re.search(r"a secret of this agent's own \((\S+); loopback only\)", done.stderr)
    assert found, done.stderr[-3000:]
    assert not os.path.exists(found.group(1)), "the ephemeral secret outlived its agent"


@pytest.mark.slow
def test_insecure_no_secret_is_said_once_and_works(tmp_path: Path) -> None:
    done, events = run_standalone(tmp_path, FLAG_INSECURE_NO_SECRET)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sum('"saved"' in e for e in events) == 3, events
    assert done.stderr.count(f"{FLAG_INSECURE_NO_SECRET}: the checkpoint service") == 1, done.stderr[-3000:]
