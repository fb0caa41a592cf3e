"""Images on kelastic local: which Python environment plays a container image.

kelastic local runs containers as processes, not images. By default every image
is played by the Python environment that runs the kubelet (``python`` means
:data:`sys.executable`, a bare console-script name is looked up in that
environment). An :class:`ImageMap` maps image names to other interpreters, so a
pod can run in an environment that differs from the kubelet's, e.g. one with
torch but without kelastic, as a worker image on a real cluster would be::

    kelastic local run --image pytorch/pytorch:2.4.0=/opt/venvs/torch/bin/python job.yaml

For a mapped image, a container's ``python``/``python3``/``python3.X`` is that
interpreter, a bare command name is looked up first in the interpreter's ``bin``
directory, and that directory is put first on the container's ``PATH``. Images
that are not mapped keep the default.

Volume mount paths: containers share the host's filesystem, so a volume cannot
appear at its ``mountPath``. For emptyDir, configMap, secret and
persistentVolumeClaim volumes the kubelet rewrites the mount path where a
container names it in its command line and environment (``/data/x`` becomes
``<the volume's host directory>/x``); see :func:`relocate`. Paths the kubelet itself
resolves (the interpreter or console script that plays the image) are host paths and
are never relocated, even when a volume is mounted above them (an emptyDir at
``/tmp`` and a venv under ``/tmp``); see :func:`relocate_argv`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ImageMap", "mount_table", "parse_image_option", "relocate", "relocate_argv"]

_PYTHON_NAMES = re.compile(r"^python(3(\.\d+)?)?$")


def parse_image_option(text: str) -> tuple[str, str]:
    """``NAME=PYTHON`` → (image, absolute interpreter path); ValueError says what is wrong."""
    name, sep, python = text.partition("=")
    if not sep or not name or not python:
        raise ValueError(
            f"--image {text!r}: expected NAME=PYTHON, e.g. pytorch/pytorch:2.4=/opt/torch/bin/python"
        )
    path = Path(python).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    # An interpreter in a venv is a symlink into the base installation: keep the link,
    # whose location makes it the venv's interpreter.
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"--image {text!r}: {path} is not an executable interpreter")
    return name, str(path)


@dataclass(frozen=True)
class ImageMap:
    """Image name → interpreter playing it; images not listed use the kubelet's Python."""

    pythons: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_options(cls, options: Iterable[str]) -> ImageMap:
        return cls(dict(parse_image_option(o) for o in options))

    def python_for(self, image: str) -> str | None:
        return self.pythons.get(image)

    def resolve(self, container: Mapping[str, Any], argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """argv with argv[0] resolved in the image's environment (unchanged for an unmapped image).

        ``argv`` is the command line as the default environment resolved it; argv[0] is
        taken again from the container's own ``command`` (or ``args``) for a mapped image.
        """
        python = self.python_for(str(container.get("image", "")))
        if python is None or not argv:
            return list(argv)
        raw = [*(container.get("command") or []), *(container.get("args") or [])]
        first = str(raw[0]) if raw else argv[0]
        bin_dir = os.path.dirname(python)
        if _PYTHON_NAMES.match(first):
            first = python
        elif "/" not in first:
            candidate = os.path.join(bin_dir, first)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                first = candidate
        return [first, *argv[1:]]

    def environment(self, container: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with a mapped image's ``bin`` directory first on ``PATH``."""
        python = self.python_for(str(container.get("image", "")))
        if python is None:
            return dict(env)
        path = env.get("PATH", os.defpath)
        return {**env, "PATH": os.pathsep.join([os.path.dirname(python), path])}


#: Volume kinds whose host directory is private to kelastic local (their mount path is relocated).
_RELOCATED_KINDS = ("emptyDir", "configMap", "secret", "persistentVolumeClaim", "projected", "downwardAPI")


def mount_table(
    pod: Mapping[str, Any], container: Mapping[str, Any], volumes: Mapping[str, Path]
) -> dict[str, str]:
    """``mountPath`` → host directory for the container's mounts of relocated volume kinds.

    hostPath mounts are listed as themselves (they are mounted at their own path), so a
    hostPath mounted inside a relocated mount path keeps its place, as the more specific
    mount would on a real node.
    """
    host_paths = {v.get("name") for v in (pod.get("spec") or {}).get("volumes") or [] if "hostPath" in v}
    kinds = {
        v.get("name"): next((k for k in _RELOCATED_KINDS if k in v), None)
        for v in (pod.get("spec") or {}).get("volumes") or []
    }
    table: dict[str, str] = {}
    for mount in container.get("volumeMounts") or []:
        name = mount.get("name", "")
        target = str(mount.get("mountPath", "")).rstrip("/")
        if name in host_paths and target.startswith("/"):
            table[target] = target
            continue
        if kinds.get(name) is None or name not in volumes or not target.startswith("/"):
            continue
        source = volumes[name] / mount["subPath"] if mount.get("subPath") else volumes[name]
        table[target] = str(source)
    return table


def relocate(text: str, table: Mapping[str, str]) -> str:
    """Replace mount paths in ``text`` by their host directories.

    A mount path counts where it starts a path: at the start of ``text`` or after
    ``=``, ``:`` or ``,`` (``--dir=/data/x``, ``PYTHONPATH=/a:/data``), and is followed
    by ``/``, one of those separators, or the end. Longer mount paths win.
    """
    if not table:
        return text
    targets = sorted(table, key=len, reverse=True)
    pattern = re.compile(r"(?:^|(?<=[=:,]))(" + "|".join(map(re.escape, targets)) + r")(?=$|[/=:,])")
    return pattern.sub(lambda m: table[m.group(1)], text)


def relocate_argv(argv: Sequence[str], written: str, table: Mapping[str, str]) -> list[str]:
    """``argv`` with mount paths replaced by host directories (:func:`relocate`), except an
    ``argv[0]`` that the kubelet resolved itself: when it differs from ``written`` (the
    container's own first word, ``python`` or a console-script name) it is a host path of the
    image's Python environment, which no volume of the pod can cover."""
    if not argv:
        return []
    first = argv[0] if argv[0] != written else relocate(argv[0], table)
    return [first, *(relocate(a, table) for a in argv[1:])]


# -- an environment with torch and nothing of kelastic ------------------------------------
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _requirement_closure(roots: Iterable[str]) -> list[Any]:
    """The installed distributions ``roots`` need (extras left out), roots included."""
    from importlib import metadata

    seen: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional or platform-specific requirement that is not installed
        seen[name] = dist
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            match = _REQUIREMENT_NAME.match(req)
            if match:
                todo.append(match.group(1))
    return list(seen.values())


def torch_environment(dest: Path, packages: Sequence[str] = ("torch", "numpy")) -> Path:
    """Make a Python environment at ``dest`` holding only ``packages`` and what they require.

    It plays a stock PyTorch image on kelastic local: a venv without system site
    packages whose site-packages links the installed torch, NumPy and their
    dependencies (not kelastic, kopf, kubernetes, aiohttp or PyYAML). Returns its
    interpreter, for ``--image NAME=PYTHON``. Raises RuntimeError if a package is not
    installed in this environment.
    """
    import subprocess
    import sys

    missing = [p for p in packages if not _requirement_closure([p])]
    if missing:
        raise RuntimeError(f"cannot build a torch environment: {', '.join(missing)} not installed here")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    python = dest / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    )
    for dist in _requirement_closure(packages):
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith((".", "/"))}
        for top in sorted(tops - {"bin", "__pycache__"}):
            source = Path(str(dist.locate_file(top)))
            link = site / top
            if source.exists() and not link.exists():
                link.symlink_to(source)
    return python
