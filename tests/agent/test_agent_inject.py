"""The injected agent: copied out of this package, run by a Python that has torch and nothing of ours.

The worker image of a real cluster has Python and torch only; ``spec.agent: inject``
copies the agent into it (:mod:`kelastic.agent.inject`). These tests build such an
environment for real (a venv linking only torch, NumPy and their requirements, see
:func:`kelastic.localcluster.kubelet.images.torch_environment`), prove that it cannot import
kelastic, kopf, kubernetes, aiohttp or yaml, and run a two-rank gloo job through the
injected launcher in it: the agent's import path needs nothing else.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from kelastic.agent import contract, inject
from kelastic.agent.inject import PUBLIC_PACKAGES, install
from kelastic.localcluster.kubelet.images import torch_environment

pytestmark = pytest.mark.slow

FORBIDDEN = ("kelastic", "kopf", "kubernetes", "aiohttp", "yaml")

SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from kelastic.agent.progress import update  # the worker sees the injected package too

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
update(1, 1)
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"kopf", "kubernetes", "aiohttp", "yaml"})
import kelastic.agent
print(f"rank {dist.get_rank()} sum {int(t.item())} from {kelastic.agent.__path__[0]} extra {loaded}", flush=True)
dist.destroy_process_group()
"""

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def torch_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield torch_environment(tmp_path_factory.mktemp("torch-env") / "venv")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PET_", "KELASTIC_"))}
    return {**env, "TORCH_CPP_LOG_LEVEL": "ERROR"}


def test_the_torch_environment_has_none_of_our_dependencies(torch_python: Path) -> None:
    for name in FORBIDDEN:
        proc = subprocess.run(
            [str(torch_python), "-c", f"import {name}"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
        assert proc.returncode == 1 and f"No module named '{name}'" in proc.stderr, (name, proc.stderr)
    ok = subprocess.run([str(torch_python), "-c", "import torch, numpy"], env=_env(), timeout=600)
    assert ok.returncode == 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("warm", [True, False], ids=["warm-start", "fresh-start"])
def test_injected_agent_runs_a_job_with_only_torch(torch_python: Path, tmp_path: Path, warm: bool) -> None:
    launcher = install(tmp_path / "agent")
    assert launcher == tmp_path / "agent" / contract.INJECT_LAUNCHER
    assert not list((tmp_path / "agent").rglob("__pycache__"))
    (tmp_path / "job.py").write_text(SCRIPT)
    cmd = [str(torch_python), str(launcher), "--standalone", "--nnodes", "1", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, *(["--warm-start"] if warm else []), "job.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=800,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    lib = str(tmp_path / "agent" / contract.INJECT_LIB / "kelastic" / "agent")
    for rank in (0, 1):
        assert f"rank {rank} sum 3 from {lib} extra []" in output, output[-4000:]


def test_reinstalling_replaces_the_previous_copy(tmp_path: Path) -> None:
    dest = tmp_path / "agent"
    install(dest)
    stale = dest / contract.INJECT_LIB / "kelastic" / "agent" / "stale.py"
    stale.write_text("")
    install(dest)
    assert not stale.exists()
    assert sorted(p.name for p in dest.iterdir()) == [contract.INJECT_LAUNCHER, contract.INJECT_LIB]
    mode = (dest / contract.INJECT_LIB).stat().st_mode & 0o777
    assert mode == 0o755  # workers may run as another user than the init container


def test_a_python_without_torch_gets_a_clear_message(tmp_path: Path) -> None:
    launcher = install(tmp_path / "agent")
    # -S: no site-packages, so no torch (a plain python image).
    proc = subprocess.run(
        [sys.executable, "-S", str(launcher), "--standalone", "train.py"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert proc.returncode == 1
    assert "cannot import torch" in proc.stderr and "needs PyTorch installed" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_python_without_numpy_is_warned_that_checkpoints_need_it(tmp_path: Path) -> None:
    launcher = install(tmp_path / "agent")
    # torch's wheels do not require NumPy; torch.distributed's object collectives do.
    program = (
        "import runpy, sys; sys.modules['numpy'] = None; "
        f"sys.argv = [{str(launcher)!r}, '--help']; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    warning = [line for line in proc.stderr.splitlines() if line.startswith("kelastic-agent: warning:")]
    assert len(warning) == 1 and "cannot import numpy" in warning[0] and "Install numpy" in warning[0], (
        proc.stderr
    )
    assert "usage: kelastic-agent" in proc.stdout


def test_inject_cli_usage_and_unwritable_destination(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "kelastic.agent.inject"]
    usage = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage: python -m kelastic.agent.inject DEST" in usage.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    failed = subprocess.run([*run, str(blocker / "sub")], capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and f"cannot write the agent into {blocker / 'sub'}" in failed.stderr


def test_an_installed_kelastic_injects_its_public_packages_from_beside_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel puts kelastic.checkpoint and kelastic.data beside kelastic/agent (no agent/public/),
    as in the kelastic image; the injected copy holds them all the same."""
    installed = tmp_path / "site-packages" / "kelastic"
    (installed / "agent").mkdir(parents=True)
    (installed / "agent" / "__init__.py").write_text("")
    for name in PUBLIC_PACKAGES:
        (installed / name).mkdir()
        (installed / name / "__init__.py").write_text(f"NAME = {name!r}\n")
    monkeypatch.setattr(inject, "_package_root", lambda: installed / "agent")
    install(tmp_path / "dest")
    lib = tmp_path / "dest" / contract.INJECT_LIB / "kelastic"
    assert sorted(p.name for p in lib.iterdir()) == sorted(["agent", *PUBLIC_PACKAGES])
    (installed / "data" / "__init__.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"kelastic\.data is in neither"):
        install(tmp_path / "dest")


def test_the_public_packages_are_the_ones_the_package_ships() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(
        p.name for p in (REPO / "agent" / "public").iterdir() if (p / "__init__.py").exists()
    ) == sorted(PUBLIC_PACKAGES)
    for name in PUBLIC_PACKAGES:
        assert setuptools["package-dir"][f"kelastic.{name}"] == f"agent/public/{name}"
