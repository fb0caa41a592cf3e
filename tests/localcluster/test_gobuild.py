"""The local cluster's Go builds (localcluster/controlplane/build.sh, localcluster/kueue/build.sh)
and what they share (localcluster/gobuild.sh), run as ``make`` runs them, with a stand-in for
the go command: a complete directory is reused without Go, a missing Go and a version the
module proxy refuses are named, a second build waits for the first and reuses its result.
The builds themselves run in CI's control-plane and Kueue lanes."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
CONTROL_PLANE = REPO / "localcluster" / "controlplane" / "build.sh"
KUEUE = REPO / "localcluster" / "kueue" / "build.sh"

#: A go command whose module proxy refuses every module.
REFUSING_GO = """#!/usr/bin/env bash
case "$1" in
    env) echo "/nowhere/$2" ;;
    *) echo "go: $REFUSED: reading https://proxy.example/x.info: 404 Not Found" >&2; exit 1 ;;
esac
"""


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    fake = tmp_path / "go"
    fake.write_text(REFUSING_GO)
    fake.chmod(0o755)
    yield {
        **os.environ,
        "GO": str(fake),
        "KELASTIC_K8S_CACHE": str(tmp_path / "k8s"),
        "KELASTIC_KUEUE_CACHE": str(tmp_path / "kueue"),
        "KELASTIC_BUILD_HEARTBEAT": "60",
        "K8S_VERSION": "v1.37.2",
        "ETCD_VERSION": "v3.7.3",
        "KUEUE_VERSION": "v0.17.0",
    }


def build(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


def complete_control_plane(root: Path) -> Path:
    bin_dir = root / "v1.37.2" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / ".kelastic-complete").write_text("kubernetes v1.37.2 etcd v3.7.3\n")
    return bin_dir


def complete_kueue(root: Path) -> Path:
    dest = root / "v0.17.0"
    (dest / "bin").mkdir(parents=True)
    (dest / "bin" / "kueue").write_text("#!/bin/sh\n")
    (dest / "bin" / "kueue").chmod(0o755)
    (dest / ".kelastic-complete").write_text("kueue v0.17.0\n")
    return dest


def test_a_complete_build_is_reused_without_go(env: dict[str, str]) -> None:
    env["GO"] = "/nonexistent/go"
    cp = complete_control_plane(Path(env["KELASTIC_K8S_CACHE"]))
    kueue = complete_kueue(Path(env["KELASTIC_KUEUE_CACHE"]))
    for script, expected in ((CONTROL_PLANE, cp), (KUEUE, kueue)):
        done = build(script, env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == str(expected) and done.stderr == ""


@pytest.mark.parametrize(("script", "minimum"), [(CONTROL_PLANE, "1.26"), (KUEUE, "1.25")])
def test_a_missing_go_is_named(env: dict[str, str], script: Path, minimum: str) -> None:
    env["GO"] = "/nonexistent/go"
    done = build(script, env)
    assert done.returncode == 1 and done.stdout == ""
    assert f"no Go toolchain ('/nonexistent/go' is not on PATH); install Go {minimum} or newer" in done.stderr


def test_the_refused_module_and_version_are_named(env: dict[str, str]) -> None:
    env["REFUSED"] = "sigs.k8s.io/kueue@v0.17.0"
    done = build(KUEUE, env)
    assert done.returncode == 1 and done.stdout == ""
    assert "kueue build: ERROR: fetching sigs.k8s.io/kueue@v0.17.0 failed" in done.stderr
    assert "refused module sigs.k8s.io/kueue version v0.17.0 (404 Not Found)" in done.stderr
    root = Path(env["KELASTIC_KUEUE_CACHE"])
    assert not list(root.glob("partial.*/")) and not (root / "v0.17.0").exists()

    env["REFUSED"] = "k8s.io/kubernetes@v1.37.2"
    done = build(CONTROL_PLANE, env)
    assert done.returncode == 1
    assert "control-plane build: ERROR: fetching k8s.io/kubernetes@v1.37.2's go.mod failed" in done.stderr
    assert "refused module k8s.io/kubernetes version v1.37.2 (404 Not Found)" in done.stderr
    dest = Path(env["KELASTIC_K8S_CACHE"]) / "v1.37.2"
    kept = list(dest.glob("work.*"))
    assert len(kept) == 1 and f"the work directory stays for inspection: {kept[0]}" in done.stderr
    assert not list(dest.glob("bin.partial.*")) and not (dest / "bin").exists()


def test_a_second_build_waits_for_the_first_and_reuses_its_result(
    env: dict[str, str], tmp_path: Path
) -> None:
    root = Path(env["KELASTIC_KUEUE_CACHE"])
    root.mkdir()
    lock = root / ".v0.17.0.lock"
    holder = subprocess.Popen(
        ["flock", str(lock), "bash", "-c", "echo held; read -r _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.Popen(
            ["bash", str(KUEUE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert second.stderr is not None
        line = second.stderr.readline()
        assert "another build of Kueue v0.17.0 is running; waiting for it" in line, line
        dest = complete_kueue(root)  # what the first build leaves
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert out.splitlines()[-1] == str(dest)


def test_the_package_ships_both_build_scripts_and_what_they_share() -> None:
    """Both scripts source localcluster/gobuild.sh: a wheel holds all three or neither works."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {Path(folder): name for name, folder in setuptools["package-dir"].items()}
    data = setuptools["package-data"]
    for script in (CONTROL_PLANE, KUEUE, REPO / "localcluster" / "gobuild.sh"):
        rel = script.relative_to(REPO)
        package = (
            f"{folders[Path('localcluster')]}." + ".".join(rel.parent.parts[1:])
            if rel.parent.parts[1:]
            else "kelastic.localcluster"
        )
        assert any(fnmatch(script.name, pattern) for pattern in data.get(package, [])), (package, script.name)
    for script in (CONTROL_PLANE, KUEUE):
        assert 'source "$(dirname "${BASH_SOURCE[0]}")/../gobuild.sh"' in script.read_text()
