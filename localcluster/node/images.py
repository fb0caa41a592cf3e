"""The real nodes' images, made here: no registry is reached.

- the sandbox (pause) image: ``make node``'s static ``pause`` binary in a one-layer image,
  named :data:`~kelastic.localcluster.node.configs.PAUSE_IMAGE` (containerd pins it);
- :data:`DEBIAN_IMAGE`: a Debian root filesystem from ``debootstrap --variant=minbase``
  with ``python3``, enough for pods that run small Python programs. The layer is built once
  per machine into ``~/.cache/kelastic/node/images`` (``$KELASTIC_NODE_CACHE``), which takes
  about a minute and needs root and the Debian mirror.

An image is written as an OCI image layout (:func:`write_layout`) and imported into a node's
containerd with ``ctr -n k8s.io images import``; the names are fully qualified, as the CRI
looks them up.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "DEBIAN_IMAGE",
    "PYTHON_BASE_IMAGE",
    "ImageFailed",
    "collect_garbage",
    "debian_layer",
    "debian_layer_path",
    "import_layout",
    "merge_layouts",
    "pause_layer",
    "python_base_layer",
    "python_base_layer_path",
    "reachable_blobs",
    "share_blobs",
    "unique_blob_bytes",
    "write_layout",
]

#: The Debian image with python3 that the lane's pods run.
DEBIAN_IMAGE = "docker.io/kelastic/debian-python:bookworm"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("KELASTIC_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The name the Dockerfile's ``FROM`` uses; the lane's stand-in (:func:`python_base_layer`)
#: is made under it, so the Dockerfile builds as it is.
PYTHON_BASE_IMAGE = "docker.io/library/python:3.11-slim"
PYTHON_BASE_PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates")
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class ImageFailed(RuntimeError):
    """An image could not be made or imported; the message says what to do."""


def cache_dir() -> Path:
    root = (
        os.environ.get("KELASTIC_NODE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kelastic" / "node"
    )
    return Path(root) / "images"


def pause_layer(pause_binary: Path, out: Path) -> Path:
    """A layer tar holding ``/pause`` (mode 0755, root's)."""
    data = pause_binary.read_bytes()
    with tarfile.open(out, "w") as tar:
        info = tarfile.TarInfo("pause")
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
    return out


def debian_layer_path() -> Path:
    """Where the Debian layer tar is cached (it may not be built yet)."""
    return cache_dir() / f"debian-{DEBIAN_SUITE}-python3.tar"


def debian_layer(progress: Callable[[str], None]) -> Path:
    """The cached Debian layer tar (built on first use with debootstrap; needs root)."""
    return _debootstrap_layer(debian_layer_path(), ("python3",), progress)


def python_base_layer_path() -> Path:
    """Where the stand-in ``python:3.11-slim`` layer tar is cached (it may not be built yet)."""
    return cache_dir() / f"debian-{DEBIAN_SUITE}-python-base.tar"


def python_base_layer(progress: Callable[[str], None]) -> Path:
    """The cached layer tar of :data:`PYTHON_BASE_IMAGE`, the stand-in for the Dockerfile's
    ``FROM python:3.11-slim`` (built on first use with debootstrap; needs root).

    Debian bookworm's own Python is 3.11: ``python3`` with ``pip`` and ``venv``, ``python`` and
    ``pip`` on PATH, pip free to install into the system (``EXTERNALLY-MANAGED`` removed, as in
    the official image), ``groupadd``/``useradd``, and the host's CA bundle, so that a ``RUN pip
    install`` trusts the package index exactly as the host does (also behind a TLS-inspecting
    egress proxy whose CA the host trusts).
    """
    return _debootstrap_layer(python_base_layer_path(), PYTHON_BASE_PACKAGES, progress, _finish_python_base)


def _finish_python_base(rootfs: Path) -> None:
    for marker in (rootfs / "usr" / "lib").glob("python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    bin_dir = rootfs / "usr" / "local" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, target in (("python", "/usr/bin/python3"), ("pip", "/usr/bin/pip3")):
        if not (rootfs / "usr" / "bin" / name).exists() and not (bin_dir / name).exists():
            (bin_dir / name).symlink_to(target)
    host_bundle = Path(HOST_CA_BUNDLE)
    if host_bundle.is_file():
        shutil.copyfile(host_bundle, rootfs / "etc" / "ssl" / "certs" / "ca-certificates.crt")


def _debootstrap_layer(
    layer: Path,
    packages: Sequence[str],
    progress: Callable[[str], None],
    finish: Callable[[Path], None] | None = None,
) -> Path:
    """``layer``, made once: a ``debootstrap --variant=minbase`` Debian with ``packages``,
    ``finish`` applied to its root, packed as an uncompressed tar. Concurrent callers wait for
    the first (a lock beside it); an interrupted build leaves only ``*.partial.*`` files."""
    if layer.is_file():
        return layer
    cache = layer.parent
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if layer.is_file():
            return layer
        if shutil.which("debootstrap") is None:
            raise ImageFailed("no debootstrap to make the Debian image: apt-get install -y debootstrap")
        rootfs = cache / f"rootfs.partial.{os.getpid()}"
        shutil.rmtree(rootfs, ignore_errors=True)
        started = time.monotonic()
        progress(
            f"building {layer.name} with debootstrap ({DEBIAN_SUITE}, {', '.join(packages)}; "
            "once per machine, one to two minutes)"
        )
        argv = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(packages)}",
            DEBIAN_SUITE,
            str(rootfs),
            DEBIAN_MIRROR,
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            shutil.rmtree(rootfs, ignore_errors=True)
            raise ImageFailed(
                f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        for cached in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cached).glob("*.deb"):
                entry.unlink()
        if finish is not None:
            finish(rootfs)
        partial = layer.with_suffix(f".partial.{os.getpid()}")
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."], check=True)
        shutil.rmtree(rootfs, ignore_errors=True)
        partial.replace(layer)
        progress(f"{layer.name}: {layer.stat().st_size / 1e6:.0f} MB in {time.monotonic() - started:.0f} s")
    return layer


def _put(blobs: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}"


def _put_file(blobs: Path, path: Path) -> tuple[str, int]:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    target = blobs / sha.hexdigest()
    if not target.exists():
        try:
            os.link(path, target)
        except OSError:
            shutil.copyfile(path, target)
    return f"sha256:{sha.hexdigest()}", path.stat().st_size


def write_layout(out: Path, name: str, layers: Sequence[Path], *, entrypoint: Sequence[str] = ()) -> Path:
    """An OCI image layout in ``out`` of uncompressed ``layers``, named ``name`` (fully qualified)."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    descriptors = []
    for layer in layers:
        digest, size = _put_file(blobs, layer)
        descriptors.append(
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest, "size": size}
        )
    config_body: dict[str, object] = {"Env": [PATH_ENV]}
    if entrypoint:
        config_body["Entrypoint"] = list(entrypoint)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": config_body,
            "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in descriptors]},
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _put(blobs, config),
                "size": len(config),
            },
            "layers": descriptors,
        },
        sort_keys=True,
    ).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": _put(blobs, manifest),
                "size": len(manifest),
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1],
                },
            }
        ],
    }
    (out / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (out / "index.json").write_text(json.dumps(index))
    return out


#: Media types whose blob lists other manifests (an image index, a Docker manifest list).
INDEX_TYPES = frozenset(
    {"application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json"}
)
#: Media types whose blob names a config and layers (an image or attestation manifest).
MANIFEST_TYPES = frozenset(
    {"application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"}
)


def reachable_blobs(layout: Path) -> dict[str, int]:
    """Every blob an OCI image layout's ``index.json`` reaches (through image indexes and
    manifests to configs and layers): hex digest -> size in bytes, as the descriptors say.
    A builder that writes into an existing layout (BuildKit) leaves the blobs of earlier
    builds beside these; only these are part of its images. ImageFailed when a manifest or
    index it names is missing (the layout is incomplete: build it again)."""
    blobs = layout / "blobs" / "sha256"
    found: dict[str, int] = {}
    pending: list[dict[str, object]] = list(json.loads((layout / "index.json").read_text())["manifests"])
    while pending:
        descriptor = pending.pop()
        digest = str(descriptor["digest"]).removeprefix("sha256:")
        if digest in found:
            continue
        found[digest] = int(str(descriptor["size"]))
        media_type = descriptor.get("mediaType")
        if media_type not in INDEX_TYPES and media_type not in MANIFEST_TYPES:
            continue
        try:
            body = json.loads((blobs / digest).read_text())
        except FileNotFoundError:
            raise ImageFailed(
                f"{layout} names {media_type} sha256:{digest}, which it lacks: build it again"
            ) from None
        if media_type in INDEX_TYPES:
            pending += body.get("manifests", [])
        else:
            pending += [body["config"], *body.get("layers", [])]
    return found


def collect_garbage(layout: Path) -> int:
    """Remove the blobs of ``layout`` that its ``index.json`` does not reach
    (:func:`reachable_blobs`); the bytes freed."""
    keep = reachable_blobs(layout)
    freed = 0
    for blob in (layout / "blobs" / "sha256").iterdir():
        if blob.name not in keep:
            stat = blob.stat()
            blob.unlink()
            # A blob also linked elsewhere frees nothing yet.
            freed += stat.st_size if stat.st_nlink == 1 else 0
    return freed


def share_blobs(layouts: Sequence[Path]) -> int:
    """Make each blob that several ``layouts`` hold one file (hard links; each layout on the same
    file system as the first that holds it): two images built with the same torch layer keep
    it on disk once. The bytes freed."""
    first: dict[str, Path] = {}
    freed = 0
    for layout in layouts:
        for blob in sorted((layout / "blobs" / "sha256").iterdir()):
            kept = first.setdefault(blob.name, blob)
            if kept == blob:
                continue
            kept_stat, stat = kept.stat(), blob.stat()
            if kept_stat.st_dev != stat.st_dev or kept_stat.st_ino == stat.st_ino:
                continue  # another file system, or one file already
            spare = blob.with_name(f".{blob.name}.link")
            spare.unlink(missing_ok=True)
            os.link(kept, spare)
            spare.replace(blob)  # atomic: the layout never lacks the blob
            freed += stat.st_size if stat.st_nlink == 1 else 0
    return freed


def merge_layouts(out: Path, layouts: Sequence[Path]) -> Path:
    """One OCI image layout in ``out`` holding every image of ``layouts`` and the blobs they
    reach, no others (hard-linked, copied across file systems): images that share layers (the
    kelastic and PyTorch images share torch's) are then imported, hashed and unpacked once,
    and blobs of earlier builds left in a layout are not imported at all."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    manifests: list[object] = []
    for layout in layouts:
        for digest in reachable_blobs(layout):
            blob, target = layout / "blobs" / "sha256" / digest, blobs / digest
            if not target.exists():
                try:
                    os.link(blob, target)
                except FileNotFoundError:
                    raise ImageFailed(f"{layout} lacks its blob sha256:{digest}: build it again") from None
                except OSError:
                    shutil.copyfile(blob, target)
        manifests += json.loads((layout / "index.json").read_text())["manifests"]
    (out / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (out / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    return out


def unique_blob_bytes(layouts: Sequence[Path]) -> int:
    """The bytes of the distinct blobs ``layouts`` (directories) reach, or of the files given
    (OCI tars): what importing them all writes into a content store."""
    seen: dict[str, int] = {}
    total = 0
    for layout in layouts:
        if layout.is_file():
            total += layout.stat().st_size
        else:
            seen.update(reachable_blobs(layout))
    return total + sum(seen.values())


def import_layout(ctr: Path, socket: Path, layout: Path, *, discard_layers: bool = False) -> None:
    """``ctr -a socket -n k8s.io images import`` of an OCI image layout (a directory, sent as a
    tar) or of an OCI tar (a file); ``discard_layers`` lets containerd drop the layers' blobs
    once unpacked (for large images: torch's gigabytes are kept once, as a snapshot).
    ImageFailed with its output."""
    argv = [str(ctr), "-a", str(socket), "-n", "k8s.io", "images", "import"]
    if discard_layers:  # which only ctr's own import (--local) offers
        argv += ["--local", "--discard-unpacked-layers"]
    if layout.is_file():
        done = subprocess.run([*argv, str(layout)], capture_output=True, text=True, timeout=1800)
    else:
        # ingest/: what a writer of the layout (BuildKit) keeps for unfinished blobs.
        tar = subprocess.Popen(
            ["tar", "-C", str(layout), "--exclude=./ingest", "-cf", "-", "."], stdout=subprocess.PIPE
        )
        done = subprocess.run([*argv, "-"], stdin=tar.stdout, capture_output=True, text=True, timeout=1800)
        if tar.stdout is not None:
            tar.stdout.close()
        tar.wait()
    if done.returncode != 0:
        raise ImageFailed(
            f"ctr images import of {layout} failed ({done.returncode}): {done.stderr.strip()[-1500:]}"
        )
