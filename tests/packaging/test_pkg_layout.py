"""The checkout's folders must not shadow standard-library modules.

``operator/`` is ``kelastic.operator``; run from a checkout's root, ``python -m …``
puts that root first on sys.path, where the folder could pass for the standard
library's ``operator``. ``-S`` skips site initialisation, which otherwise may
import the real module early and hide the problem (as in a fresh virtualenv).

And every package folder of the checkout is installed: pyproject.toml names packages one
by one, so a new subpackage left out of the list works from a checkout and is missing from
the wheel and the image.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


ROOT = Path(__file__).resolve().parents[2]


def test_stdlib_operator_wins_from_the_checkout_root() -> None:
    code = (
        "import collections, operator, sysconfig, pathlib;"
        "assert pathlib.Path(operator.__file__).parent == pathlib.Path(sysconfig.get_path('stdlib')), operator.__file__;"
        "assert operator.itemgetter(1)([5, 6]) == 6;"
        "print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_kelastic_operator_still_imports_as_a_package() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import kelastic.operator as o; print(o.reconcile.__module__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "kelastic.operator.reconcile"


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml lists its packages one by one: a subpackage missing from the list is
    absent from the wheel and the image, though every import works from a checkout."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {Path(folder): name for name, folder in setuptools["package-dir"].items()}
    found = set()
    for init in ROOT.glob("*/**/__init__.py"):
        folder = init.parent.relative_to(ROOT)
        # the installed name comes from the nearest folder package-dir maps (agent/public/data is
        # kelastic.data, not kelastic.agent.public.data)
        base = max(
            (f for f in folders if folder == f or f in folder.parents),
            key=lambda f: len(f.parts),
            default=None,
        )
        if base is not None:
            found.add(".".join([folders[base], *folder.relative_to(base).parts]))
    missing = sorted(found - set(setuptools["packages"]))
    assert not missing, (
        f"packages of the source tree that pyproject.toml [tool.setuptools] packages lacks: {missing}"
    )
