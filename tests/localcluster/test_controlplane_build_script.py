"""localcluster/controlplane/build.sh's knobs, checked before any Go runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "localcluster" / "controlplane" / "build.sh"


def build(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "KELASTIC_K8S_CACHE": str(tmp_path), "GO": "/nonexistent/go", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("components", "says"),
    [
        ("kube-apiserver kube-proxy", "K8S_COMPONENTS names kube-proxy; it may name only: kube-apiserver"),
        ("kubectl", "K8S_COMPONENTS must include kube-apiserver"),
    ],
)
def test_a_subset_must_be_known_components_with_the_api_server(
    tmp_path: Path, components: str, says: str
) -> None:
    done = build(tmp_path, K8S_COMPONENTS=components)
    assert done.returncode == 1 and says in done.stderr, done.stderr
    assert not any(tmp_path.iterdir()), "nothing is built or locked for a refused subset"


def test_a_subset_build_is_not_taken_for_a_whole_one(tmp_path: Path) -> None:
    """A directory built for a subset is complete for that subset only (its marker says so)."""
    bin_dir = tmp_path / "v1.30.14" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / ".kelastic-complete").write_text("kubernetes v1.30.14 etcd v3.7.3 only kube-apiserver\n")
    subset = build(tmp_path, K8S_VERSION="v1.30.14", K8S_COMPONENTS="kube-apiserver")
    assert (subset.returncode, subset.stdout.strip()) == (0, str(bin_dir))
    whole = build(tmp_path, K8S_VERSION="v1.30.14")  # would rebuild, and there is no Go here
    assert whole.returncode == 1 and "no Go toolchain" in whole.stderr, whole.stderr
