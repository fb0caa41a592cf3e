"""Copy a self-contained kelastic agent into a directory, for images without kelastic.

``python -m kelastic.agent.inject DEST`` (the operator's init container runs it from
the operator's image, with DEST an ``emptyDir`` shared with the worker containers)
writes:

- ``DEST/lib/kelastic/agent/...``: the ``kelastic.agent`` package (its ``.py`` files
  only), and beside it the short names workers import, ``kelastic.checkpoint`` and
  ``kelastic.data``. It imports nothing but the standard library, torch and NumPy (through
  torch), so any image with Python >= 3.10, torch and NumPy can run it (without NumPy the
  launcher warns: torch.distributed's object collectives, which checkpoints use, need it);
- ``DEST/kelastic-agent``: the launcher. A worker runs ``python DEST/kelastic-agent
  <kelastic-agent flags> <training command>`` with the image's own Python. The
  launcher puts ``DEST/lib`` first on ``sys.path`` and on ``PYTHONPATH`` (so the
  workers it starts can ``import kelastic.agent.progress`` too), checks that this
  Python can run the agent (version, torch), and says what is missing otherwise.

Both names are in :mod:`kelastic.agent.contract` (``INJECT_LIB``, ``INJECT_LAUNCHER``).
The copy is written next to the destination and renamed into place, so a restarted
init container never leaves a half-written agent behind.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from kelastic.agent.contract import INJECT_LAUNCHER, INJECT_LIB

__all__ = ["LAUNCHER", "PUBLIC_PACKAGES", "install", "main"]

#: The short public packages workers import (``kelastic.checkpoint``, ``kelastic.data``,
#: ``kelastic.inprocess``),
#: shipped with every injected agent.
PUBLIC_PACKAGES = ("checkpoint", "data", "inprocess")

#: The launcher script. Written for any Python 3 so that an older interpreter gets the
#: message instead of a SyntaxError from the agent's modules.
LAUNCHER = '''\
"""kelastic-agent, injected by the kelastic operator (see kelastic.agent.inject)."""
import os
import sys

lib = os.path.join(os.path.dirname(os.path.abspath(__file__)), "{lib}")
where = "this image's Python (" + sys.executable + ", " + sys.version.split()[0] + ")"
if sys.version_info < (3, 10):
    sys.exit("kelastic-agent: " + where + " is too old: the injected agent needs Python 3.10 or newer. "
             "Use a worker image with a newer Python.")
# Only looked up, not imported: the agent imports torch itself a moment later (once: its
# fork server is a fork of it), and an import here would be a second one on every start.
from importlib.util import find_spec
if find_spec("torch") is None:
    sys.exit("kelastic-agent: " + where + " cannot import torch (no module named 'torch'). "
             "The worker image needs PyTorch installed; kelastic brings everything else.")
sys.path.insert(0, lib)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (lib, os.environ.get("PYTHONPATH")) if p)
# multiprocessing re-runs this file as __mp_main__ in the processes it starts: only the
# agent itself may run main().
if __name__ == "__main__":
    if find_spec("numpy") is None:
        # torch's wheels do not require it, but torch.distributed's object collectives
        # (all_gather_object, and torch.distributed.checkpoint with them) fail without it.
        print("kelastic-agent: warning: " + where + " cannot import numpy: torch.distributed "
              "needs it to exchange Python objects, so checkpoints (kelastic.checkpoint, "
              "torch.distributed.checkpoint) will fail. Install numpy in the worker image.",
              file=sys.stderr, flush=True)
    sys.argv[0] = "kelastic-agent"
    from kelastic.agent.cli import main

    main()
'''


def _package_root() -> Path:
    """The folder holding this ``kelastic.agent`` package."""
    return Path(__file__).resolve().parent


def _public_packages() -> list[Path]:
    """The folders of :data:`PUBLIC_PACKAGES`: ``agent/public/NAME`` in a source tree (and an
    editable install), ``kelastic/NAME`` beside ``kelastic/agent`` once installed from a wheel
    (pyproject.toml's package-dir), as in the kelastic image. FileNotFoundError naming both
    places when one is in neither (a broken install)."""
    root = _package_root()
    found = []
    for name in PUBLIC_PACKAGES:
        places = (root / "public" / name, root.parent / name)
        folder = next((place for place in places if (place / "__init__.py").is_file()), None)
        if folder is None:
            raise FileNotFoundError(f"kelastic.{name} is in neither {places[0]} nor {places[1]}")
        found.append(folder)
    return found


def install(dest: Path) -> Path:
    """Write the agent and its launcher into ``dest`` (created if needed); return the launcher.

    Replaces an agent a previous run left there. Raises OSError naming the path that
    could not be written.
    """
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".kelastic-agent-", dir=dest))
    # Workers may run as another user than the init container: the copy must be readable.
    staging.chmod(0o755)
    try:
        target = staging / "kelastic" / "agent"
        skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")
        shutil.copytree(_package_root(), target, ignore=skip)
        # The short public names (kelastic.checkpoint, kelastic.data) that workers import
        # sit beside the agent, as in an installed kelastic.
        for public in _public_packages():
            shutil.copytree(public, staging / "kelastic" / public.name, ignore=skip)
        lib = dest / INJECT_LIB
        if lib.exists():
            shutil.rmtree(lib)
        staging.rename(lib)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    launcher = dest / INJECT_LAUNCHER
    partial = dest / f".{INJECT_LAUNCHER}.partial"
    partial.write_text(LAUNCHER.format(lib=INJECT_LIB))
    partial.chmod(0o755)
    os.replace(partial, launcher)
    return launcher


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m kelastic.agent.inject DEST", file=sys.stderr)
        return 2
    try:
        launcher = install(Path(args[0]))
    except OSError as exc:
        print(f"kelastic-agent inject: cannot write the agent into {args[0]}: {exc}", file=sys.stderr)
        return 1
    # One short line: the volume's path is the pod's business (on kelastic local a long
    # host path); the worker command names the launcher there.
    print(f"kelastic-agent inject: installed the agent ({launcher.name}, {INJECT_LIB}/) for the worker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
