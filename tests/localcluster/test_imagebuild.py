"""The lane's image build stays in step with the repository's Dockerfile: the plain PyTorch
image is the Dockerfile's own torch step on the same base (so BuildKit reuses that layer), and
the stand-in base image answers to the name the Dockerfile's ``FROM`` uses."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from kelastic.localcluster.node import images
from kelastic.localcluster.node.imagebuild import BuildKit, plain_dockerfile, torch_step_ran

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    )
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip()]


def test_the_plain_image_is_the_dockerfiles_torch_step_and_nothing_of_kelastic() -> None:
    plain = instructions(plain_dockerfile(DOCKERFILE))
    full = instructions(DOCKERFILE)
    assert plain[:-2] == full[: len(plain) - 2], "the plain image must repeat the Dockerfile's steps verbatim"
    assert re.match(r"RUN pip install .*torch==", plain[-3]), plain
    assert plain[-2] == 'RUN pip install --no-cache-dir "numpy==2.4.6"', "NumPy, as a PyTorch image has it"
    assert plain[-1] == 'CMD ["python3"]'
    assert not [step for step in plain if step.startswith(("COPY", "USER"))], plain


def test_a_dockerfile_without_a_torch_step_is_refused() -> None:
    with pytest.raises(ValueError, match="torch"):
        plain_dockerfile("FROM python:3.11-slim\nRUN pip install numpy\n")


def test_the_stand_in_base_answers_to_the_dockerfiles_from() -> None:
    (base,) = [step.split()[1] for step in instructions(DOCKERFILE) if step.startswith("FROM")]
    assert images.PYTHON_BASE_IMAGE in (base, f"docker.io/library/{base}")
    assert "stand-in" in DOCKERFILE, "the Dockerfile's comments say what the lane's stand-in base is"


def test_missing_buildkit_names_the_make_target(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make image"):
        BuildKit.find(tmp_path)


def test_a_cached_torch_step_is_a_warm_build() -> None:
    ran = '#5 [1/2] RUN pip install --no-cache-dir  "torch==2.13.0"\n#5 37.95 Installing\n#5 DONE 140.2s\n'
    cached = '#5 [1/11] RUN pip install --no-cache-dir  "torch==2.13.0"\n#5 CACHED\n#6 [2/11] WORKDIR /opt/kelastic\n'
    assert torch_step_ran(ran)
    assert not torch_step_ran(cached)
    assert not torch_step_ran("#1 [internal] load build definition from Dockerfile\n")


def test_merged_layouts_hold_every_image_and_each_shared_layer_once(tmp_path: Path) -> None:
    shared, own = tmp_path / "shared.tar", tmp_path / "own.tar"
    shared.write_bytes(b"torch" * 1000)
    own.write_bytes(b"kelastic")
    first = images.write_layout(tmp_path / "a", "docker.io/kelastic/pytorch:2.13.0", [shared])
    second = images.write_layout(tmp_path / "b", "docker.io/library/kelastic:0.1.0", [shared, own])
    merged = images.merge_layouts(tmp_path / "merged", [first, second])
    index = json.loads((merged / "index.json").read_text())
    names = [m["annotations"]["io.containerd.image.name"] for m in index["manifests"]]
    assert names == ["docker.io/kelastic/pytorch:2.13.0", "docker.io/library/kelastic:0.1.0"]
    blobs = {p.name for layout in (first, second) for p in (layout / "blobs" / "sha256").iterdir()}
    assert {p.name for p in (merged / "blobs" / "sha256").iterdir()} == blobs
    # Linked, not copied: the layer tar, both layouts and the merged one are one file.
    layer = merged / "blobs" / "sha256" / hashlib.sha256(shared.read_bytes()).hexdigest()
    assert layer.stat().st_nlink == 4
