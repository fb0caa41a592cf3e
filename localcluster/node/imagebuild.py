"""The lane's kelastic and plain PyTorch images, built by BuildKit from the repository's Dockerfile.

- :data:`KELASTIC_IMAGE` is the repository's ``Dockerfile`` built as it is, its ``FROM
  python:3.11-slim`` satisfied by the lane's stand-in (:func:`.images.python_base_layer`, given
  to BuildKit as a named context of that name): no registry is reached.
- :data:`PYTORCH_IMAGE`, the "any PyTorch image" of docs/agent-injection.md, is the same
  Dockerfile's lines up to and including its torch install (:func:`plain_dockerfile`): torch on
  the same base, nothing of kelastic. Its torch layer is the kelastic image's, from one cache.

``buildkitd`` (``make image`` builds it, ``localcluster/node/buildkit.sh``) runs for the build
only, with its OCI worker on ``make node``'s runc and the host's network (RUN steps reach the
package index as the host does). Its state, the torch layer included, is kept in
``~/.cache/kelastic/node/buildkit`` (``$KELASTIC_NODE_CACHE``), so torch is downloaded once per
machine. Each image is written as an OCI image layout (a directory) beside it, which
:meth:`.lane.RealNodeLane.start` imports into each node's containerd: a later build sends only
the blobs the layout lacks, so an unchanged torch layer is not copied again.

After a build the cache is kept bounded: the layouts lose the blobs of earlier builds and
keep the layers the two images share once (hard links), and BuildKit's cache is pruned to
:func:`cache_bound_mb` (``$KELASTIC_BUILDKIT_KEEP_MB``), which keeps the torch step.

Why not BuildKit's containerd worker: the lane's containerds live and die with the lane (their
state is removed when it stops), so a build cache in one would be gone with it, and the torch
layer would be downloaded again for every lane.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..controlplane.controlplane import die_with_parent
from . import images

__all__ = [
    "BUILDKIT_VERSION",
    "KELASTIC_IMAGE",
    "PYTORCH_IMAGE",
    "BuildKit",
    "BuiltImages",
    "build_images",
    "cache_bound_mb",
    "parse_size",
    "plain_dockerfile",
    "torch_step_ran",
]

BUILDKIT_VERSION = "v0.34.2"
#: The chart's and the operator's default image (``kelastic:0.1.0``), fully qualified.
KELASTIC_IMAGE = "docker.io/library/kelastic:0.1.0"
#: torch on the same base, without kelastic: a user's image for agent injection.
PYTORCH_IMAGE = "docker.io/kelastic/pytorch:2.13.0"
#: The NumPy of the plain PyTorch image (:data:`PLAIN_EXTRA`).
NUMPY_VERSION = "2.4.6"
REPO = Path(__file__).resolve().parents[2]


def _cache_root() -> Path:
    return images.cache_dir().parent


def default_buildkit_dir() -> Path:
    """``$KELASTIC_BUILDKIT_DIR``, else where ``make image`` puts buildkitd and buildctl."""
    if os.environ.get("KELASTIC_BUILDKIT_DIR"):
        return Path(os.environ["KELASTIC_BUILDKIT_DIR"])
    return _cache_root() / f"buildkit-{BUILDKIT_VERSION}" / "bin"


@dataclass(frozen=True)
class BuildKit:
    """The directory ``localcluster/node/buildkit.sh`` fills."""

    directory: Path

    @classmethod
    def find(cls, directory: Path | None = None) -> BuildKit:
        """FileNotFoundError naming what is missing and how to build it."""
        directory = Path(directory or default_buildkit_dir()).expanduser()
        missing = [b for b in ("buildkitd", "buildctl") if not os.access(directory / b, os.X_OK)]
        if missing:
            raise FileNotFoundError(
                f"no {' and '.join(missing)} in {directory}: run `make image` (it builds BuildKit "
                f"{BUILDKIT_VERSION} from the Go module proxy, then the images)"
            )
        return cls(directory)


#: What the plain PyTorch image adds to the torch step: NumPy, which a PyTorch image has (the
#: official ones do) and torch's wheels do not require, but torch.distributed's object
#: collectives (``all_gather_object``, and ``torch.distributed.checkpoint`` with them) need.
PLAIN_EXTRA = f'RUN pip install --no-cache-dir "numpy=={NUMPY_VERSION}"'


def plain_dockerfile(dockerfile: str) -> str:
    """The Dockerfile's instructions up to and including the ``RUN`` that installs torch, then
    :data:`PLAIN_EXTRA` and ``CMD ["python3"]``: the same base, build arguments, environment
    and torch step, so BuildKit reuses the kelastic image's torch layer. ValueError when no
    such ``RUN`` is there."""
    kept: list[str] = []
    logical = ""
    for line in dockerfile.splitlines():
        kept.append(line)
        if line.lstrip().startswith("#"):
            continue
        logical += line
        if line.rstrip().endswith("\\"):
            continue
        if re.match(r"\s*RUN\b.*\bpip install\b.*\btorch==", logical):
            return "\n".join(kept) + f'\n{PLAIN_EXTRA}\n\nCMD ["python3"]\n'
        logical = ""
    raise ValueError("the Dockerfile has no `RUN pip install ... torch==...` step")


@dataclass
class BuiltImages:
    """The OCI image layouts and what making them cost."""

    layouts: dict[str, Path]
    #: Seconds per step (base image, each build).
    timings: dict[str, float] = field(default_factory=dict)
    #: Whether the torch layer was built now (not found in BuildKit's cache).
    cold: bool = False

    def sizes(self) -> dict[str, int]:
        """Bytes of each image: its manifest's layers and config."""
        return {name: _image_size(layout) for name, layout in self.layouts.items()}


def build_images(
    runc: Path,
    buildkit: BuildKit | None = None,
    progress: Callable[[str], None] = print,
    repo: Path = REPO,
) -> BuiltImages:
    """Build (or bring up to date) :data:`KELASTIC_IMAGE` and :data:`PYTORCH_IMAGE` as OCI image layouts
    in the cache; one build per machine at a time. ImageFailed with BuildKit's last lines."""
    buildkit = buildkit or BuildKit.find()
    root = _cache_root()
    out_dir = images.cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    built = BuiltImages(layouts={})
    with open(out_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = time.monotonic()
        base = out_dir / "python-base-layout"
        if not (base / "index.json").is_file():
            images.write_layout(base, images.PYTHON_BASE_IMAGE, [images.python_base_layer(progress)])
        built.timings["base image"] = time.monotonic() - started
        manifest = json.loads((base / "index.json").read_text())["manifests"][0]["digest"]
        plain_dir = root / "buildkit-contexts" / "pytorch"
        plain_dir.mkdir(parents=True, exist_ok=True)
        (plain_dir / "Dockerfile").write_text(plain_dockerfile((repo / "Dockerfile").read_text()))
        with _buildkitd(buildkit, runc, root / "buildkit", progress) as address:
            for name, context in ((PYTORCH_IMAGE, plain_dir), (KELASTIC_IMAGE, repo)):
                layout = out_dir / (name.rsplit("/", 1)[-1].replace(":", "-") + "-layout")
                mark = time.monotonic()
                log = _build(buildkit, address, context, base, manifest, name, layout, progress)
                built.timings[name] = time.monotonic() - mark
                ran = torch_step_ran(log)
                progress(
                    f"{name}: the torch step {'ran' if ran else 'came from the cache'}; {cached_steps(log)}"
                )
                built.cold = built.cold or ran
                built.layouts[name] = layout
            mark = time.monotonic()
            _tidy_layouts(list(built.layouts.values()), progress)
            image_bytes = images.unique_blob_bytes(list(built.layouts.values()))
            keep = cache_bound_mb(image_bytes, os.environ.get("KELASTIC_BUILDKIT_KEEP_MB"))
            _prune(buildkit, address, keep, time.monotonic() - started, progress)
            built.timings["cache upkeep"] = time.monotonic() - mark
    return built


#: BuildKit's cache beyond twice the images' bytes (:func:`cache_bound_mb`): the base image's
#: record, the frontend's and the build contexts'.
CACHE_SLACK = 10**9


def cache_bound_mb(image_bytes: int, override: str | None = None) -> int:
    """The megabytes BuildKit's cache keeps after a build (``buildctl prune --keep-storage``):
    ``override`` (``$KELASTIC_BUILDKIT_KEEP_MB``) where given, else twice ``image_bytes``
    (the unique bytes of the images just built) and :data:`CACHE_SLACK`. BuildKit holds each
    step's result twice (its snapshot and its layer's blob), and prunes a step only after
    every step built on it: at this bound the torch step stays, so a build after a change of
    kelastic's sources does not install torch again, while the layers of earlier builds go.
    What a build just made or used is spared (:func:`_prune`), so the cache may stay above
    the bound by that much until the next build."""
    if override:
        return int(override)
    return -(-(2 * image_bytes + CACHE_SLACK) // 10**6)


def _tidy_layouts(layouts: list[Path], progress: Callable[[str], None]) -> None:
    """Drop the blobs of earlier builds from ``layouts`` and keep the blobs they share once."""
    freed = sum(images.collect_garbage(layout) for layout in layouts) + images.share_blobs(layouts)
    progress(f"image layouts: {freed / 1e9:.2f} GB freed (blobs of earlier builds, copies of shared layers)")


def parse_size(text: str) -> int:
    """Bytes of BuildKit's human-readable size (``18.6GB``, ``512.3kB``, ``0B``; decimal units).
    ValueError when it is not one."""
    found = re.fullmatch(r"\s*([0-9.]+)\s*([kKMGTP]?)B\s*", text)
    if not found:
        raise ValueError(f"not a size: {text!r}")
    return round(float(found.group(1)) * 1000 ** "_KMGTP".find(found.group(2).upper() or "_"))


def _buildctl_total(buildkit: BuildKit, address: str, *args: str) -> int:
    """The ``Total:`` of ``buildctl prune`` or ``du`` (bytes); ImageFailed with its output."""
    argv = [str(buildkit.directory / "buildctl"), f"--addr={address}", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    totals = [line.split(":", 1)[1] for line in done.stdout.splitlines() if line.startswith("Total:")]
    if done.returncode != 0 or not totals:
        raise images.ImageFailed(
            f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-1500:]}"
        )
    return parse_size(totals[-1])


def _prune(
    buildkit: BuildKit, address: str, keep_mb: int, build_seconds: float, progress: Callable[[str], None]
) -> None:
    """Prune BuildKit's cache to ``keep_mb`` megabytes, least used first, sparing what the
    build of the last ``build_seconds`` made or used; say what it freed. (BuildKit ranks a
    step by how recently and how often it was used, so the steps just built, used once, would
    otherwise go before older ones, and the next build would run them again.)"""
    spare = f"--keep-duration={int(build_seconds) + 60}s"
    freed = _buildctl_total(buildkit, address, "prune", f"--keep-storage={keep_mb}", spare)
    kept = _buildctl_total(buildkit, address, "du")
    progress(
        f"BuildKit's cache pruned to its bound of {keep_mb / 1e3:.1f} GB: {freed / 1e9:.2f} GB freed, "
        f"{kept / 1e9:.2f} GB kept"
    )


def _image_size(layout: Path) -> int:
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((layout / "index.json").read_text())
    while "manifests" in manifest:  # an index (also one holding attestations): its image
        (image,) = [m for m in manifest["manifests"] if (m.get("platform") or {}).get("os") != "unknown"]
        manifest = json.loads((blobs / image["digest"].split(":")[1]).read_text())
    return int(manifest["config"]["size"]) + sum(int(layer["size"]) for layer in manifest["layers"])


def torch_step_ran(log: str) -> bool:
    """Whether BuildKit ran the torch step rather than finding it in its cache: its plain
    progress names the step (``#5 [1/2] RUN pip install ... torch==...``), then ``#5 CACHED``
    when it was reused."""
    for line in log.splitlines():
        step = re.match(r"(#\d+) \[.*\] RUN .*pip install.*torch==", line)
        if step:
            return f"{step.group(1)} CACHED" not in log.splitlines()
    return False


def cached_steps(log: str) -> str:
    """How many of the build's steps (``#N [i/n] ...``) BuildKit found in its cache, in words."""
    steps = {m.group(1) for m in re.finditer(r"^(#\d+) \[\s*\d+/\d+\]", log, re.MULTILINE)}
    cached = {m.group(1) for m in re.finditer(r"^(#\d+) CACHED$", log, re.MULTILINE)} & steps
    return f"{len(cached)} of {len(steps)} steps from the cache"


@contextlib.contextmanager
def _buildkitd(buildkit: BuildKit, runc: Path, state: Path, progress: Callable[[str], None]) -> Iterator[str]:
    state.mkdir(parents=True, exist_ok=True)
    address = f"unix://{state}/buildkitd.sock"
    argv = [
        str(buildkit.directory / "buildkitd"), f"--root={state / 'root'}", f"--addr={address}",
        "--oci-worker=true", "--containerd-worker=false", f"--oci-worker-binary={runc}",
        "--oci-worker-net=host", "--oci-worker-gc=false",
    ]  # fmt: skip
    log_path = state / "buildkitd.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM), start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            done = subprocess.run(
                [str(buildkit.directory / "buildctl"), f"--addr={address}", "debug", "workers"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            if done.returncode == 0 and done.stdout.strip().count("\n") >= 1:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise images.ImageFailed(f"buildkitd did not start ({' '.join(argv)}):\n{tail}")
            time.sleep(0.3)
        progress(f"buildkitd {BUILDKIT_VERSION} up (OCI worker, runc {runc}, state {state})")
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _build(
    buildkit: BuildKit,
    address: str,
    context: Path,
    base: Path,
    manifest: str,
    name: str,
    layout: Path,
    progress: Callable[[str], None],
) -> str:
    base_ref = f"oci-layout://python-base@{manifest}"
    argv = [
        str(buildkit.directory / "buildctl"), f"--addr={address}", "build", "--progress=plain",
        "--frontend=dockerfile.v0", f"--local=context={context}", f"--local=dockerfile={context}",
        f"--oci-layout=python-base={base}",
        # The Dockerfile says `FROM python:3.11-slim`: the stand-in answers to that name
        # (BuildKit looks named contexts up by the familiar name, as the Dockerfile writes it).
        f"--opt=context:{images.PYTHON_BASE_IMAGE.removeprefix('docker.io/library/')}={base_ref}",
        # A directory, not a tar: blobs it holds already are not sent again. Uncompressed: the
        # nodes import it at once, and compressing torch's gigabytes would take minutes.
        f"--output=type=oci,tar=false,dest={layout},name={name},compression=uncompressed,force-compression=true",
    ]  # fmt: skip
    progress(f"building {name} from {context / 'Dockerfile'} with BuildKit")
    lines: list[str] = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        next_note = time.monotonic() + 30
        for line in proc.stdout:
            lines.append(line.rstrip())
            if re.match(r"#\d+ \[", line) or time.monotonic() > next_note:
                progress(f"  {line.rstrip()[:160]}")
                next_note = time.monotonic() + 30
    if proc.returncode != 0:
        raise images.ImageFailed(
            f"BuildKit could not build {name} ({proc.returncode}); its last lines:\n" + "\n".join(lines[-40:])
        )
    progress(f"{name}: {_image_size(layout) / 1e6:.0f} MB ({layout})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m kelastic.localcluster.node.imagebuild [--buildkit-dir DIR] [--node-dir DIR]``
    (``make image``): make every image the real-node lane imports (its Debian image, then both
    BuildKit images), print what it cost, then each BuildKit layout as NAME=DIR."""
    from .lane import NodeBinaries, default_node_dir

    parser = argparse.ArgumentParser(
        prog="python -m kelastic.localcluster.node.imagebuild", description=__doc__
    )
    parser.add_argument("--buildkit-dir", type=Path, default=None, help="buildkit.sh's directory")
    parser.add_argument("--node-dir", type=Path, default=None, help="make node's directory (its runc)")
    args = parser.parse_args(argv)
    say = lambda line: print(f"image build: {line}", file=sys.stderr, flush=True)  # noqa: E731
    if os.geteuid() != 0:
        say("ERROR: needs root (BuildKit runs the Dockerfile's steps in runc containers)")
        return 2
    try:
        runc = NodeBinaries.find(args.node_dir or default_node_dir())["runc"]
        buildkit = BuildKit.find(args.buildkit_dir)
        started = time.monotonic()
        images.debian_layer(say)
        debian_s = time.monotonic() - started
        built = build_images(runc, buildkit, say)
    except (FileNotFoundError, images.ImageFailed) as exc:
        say(f"ERROR: {exc}")
        return 1
    steps = ", ".join(
        f"{name} {seconds:.1f} s" for name, seconds in {"Debian image": debian_s, **built.timings}.items()
    )
    say(f"{'cold' if built.cold else 'warm'} build {time.monotonic() - started:.1f} s ({steps})")
    for name, layout in built.layouts.items():
        print(f"{name}={layout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
