"""The lane's image build stays in step with the repository's Dockerfile: the plain PyTorch
image is the Dockerfile's own torch step on the same base (so BuildKit reuses that layer), and
the stand-in base image answers to the name the Dockerfile's ``FROM`` uses."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from kelastic.localcluster.node import imagebuild, images
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


def blob_names(layout: Path) -> set[str]:
    return {p.name for p in (layout / "blobs" / "sha256").iterdir()}


def nested_layout(tmp_path: Path) -> tuple[Path, str]:
    """A layout as BuildKit leaves it after two builds: ``index.json`` -> an image index -> the
    image's manifest -> its config and layers, and a stale layer of the earlier build beside
    them. Returns the layout and the stale blob's digest."""
    layer = tmp_path / "layer.tar"
    layer.write_bytes(b"torch" * 1000)
    layout = images.write_layout(tmp_path / "built", "docker.io/library/kelastic:0.1.0", [layer])
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((layout / "index.json").read_text())["manifests"][0]
    index = json.dumps({"schemaVersion": 2, "manifests": [manifest]}).encode()
    digest = hashlib.sha256(index).hexdigest()
    (blobs / digest).write_bytes(index)
    top = {
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "digest": f"sha256:{digest}",
        "size": len(index),
    }
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [top]}))
    stale = hashlib.sha256(b"an earlier build").hexdigest()
    (blobs / stale).write_bytes(b"an earlier build" * 100)
    return layout, stale


def test_only_the_blobs_an_images_manifests_reach_are_its_own(tmp_path: Path) -> None:
    layout, stale = nested_layout(tmp_path)
    reached = images.reachable_blobs(layout)
    assert set(reached) == blob_names(layout) - {stale}
    assert len(reached) == 4  # the index, the manifest, the config and the layer
    assert images.unique_blob_bytes([layout]) == sum(reached.values())
    assert images.unique_blob_bytes([layout, layout]) == sum(reached.values())
    assert reached[hashlib.sha256(b"torch" * 1000).hexdigest()] == 5000


def test_merged_layouts_leave_a_layouts_stale_blobs_behind(tmp_path: Path) -> None:
    layout, stale = nested_layout(tmp_path)
    merged = images.merge_layouts(tmp_path / "merged", [layout])
    assert blob_names(merged) == blob_names(layout) - {stale}
    assert (
        json.loads((merged / "index.json").read_text())["manifests"]
        == json.loads((layout / "index.json").read_text())["manifests"]
    )


def test_a_layout_missing_a_manifest_says_to_build_it_again(tmp_path: Path) -> None:
    layout, _ = nested_layout(tmp_path)
    top = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"].split(":")[1]
    (layout / "blobs" / "sha256" / top).unlink()
    with pytest.raises(images.ImageFailed, match="build it again"):
        images.merge_layouts(tmp_path / "merged", [layout])


def test_garbage_collection_removes_only_the_blobs_no_manifest_reaches(tmp_path: Path) -> None:
    layout, stale = nested_layout(tmp_path)
    before = blob_names(layout)
    assert images.collect_garbage(layout) == len(b"an earlier build" * 100)
    assert blob_names(layout) == before - {stale}
    assert images.collect_garbage(layout) == 0
    merged = images.merge_layouts(tmp_path / "merged", [layout])  # the images are whole
    assert blob_names(merged) == blob_names(layout)


def test_layouts_that_share_a_layer_keep_it_once(tmp_path: Path) -> None:
    shared = tmp_path / "shared.tar"
    shared.write_bytes(b"torch" * 1000)
    first = images.write_layout(tmp_path / "a", "docker.io/kelastic/pytorch:2.13.0", [shared])
    second = images.write_layout(tmp_path / "b", "docker.io/library/kelastic:0.1.0", [shared])
    digest = hashlib.sha256(shared.read_bytes()).hexdigest()
    for layout in (first, second):  # copies, as BuildKit writes each layout
        blob = layout / "blobs" / "sha256" / digest
        blob.unlink()
        blob.write_bytes(shared.read_bytes())
    # Their configs and manifests are alike too (same layers, no entrypoint): kept once as well.
    assert blob_names(first) == blob_names(second)
    copies = sum(p.stat().st_size for p in (second / "blobs" / "sha256").iterdir() if p.name != digest)
    assert images.share_blobs([first, second]) == 5000 + copies
    for name in blob_names(first) & blob_names(second):
        a, b = (layout / "blobs" / "sha256" / name for layout in (first, second))
        assert a.stat().st_ino == b.stat().st_ino
    assert (second / "blobs" / "sha256" / digest).read_bytes() == b"torch" * 1000
    assert images.share_blobs([first, second]) == 0
    assert not list((second / "blobs" / "sha256").glob(".*"))


def test_buildkits_cache_bound_holds_every_step_of_the_images_twice() -> None:
    assert imagebuild.cache_bound_mb(5_400_000_000) == 11_800
    assert imagebuild.cache_bound_mb(5_400_000_001) == 11_801
    assert imagebuild.cache_bound_mb(5_400_000_000, "20000") == 20_000


def test_buildkits_sizes_read_as_bytes() -> None:
    assert imagebuild.parse_size("18.60GB") == 18_600_000_000
    assert imagebuild.parse_size("\t512.3kB") == 512_300
    assert imagebuild.parse_size("0B") == 0
    assert imagebuild.parse_size("1.5MB") == 1_500_000
    with pytest.raises(ValueError, match="not a size"):
        imagebuild.parse_size("lots")


def test_a_builds_cached_steps_are_counted() -> None:
    log = (
        '#5 [internal] load build context\n#5 DONE 0.1s\n#6 [ 1/11] RUN pip install "torch==2.13.0"\n#6 CACHED\n'
        "#7 [ 2/11] WORKDIR /opt/kelastic\n#7 CACHED\n#12 [ 7/11] RUN pip install .\n#12 12.3 Successfully\n#12 DONE\n"
    )
    assert imagebuild.cached_steps(log) == "2 of 3 steps from the cache"
