"""The checkout's folders must not shadow standard-library modules.

``operator/`` is ``kelastic.operator``; run from a checkout's root, ``python -m …``
puts that root first on sys.path, where the folder could pass for the standard
library's ``operator``. ``-S`` skips site initialisation, which otherwise may
import the real module early and hide the problem (as in a fresh virtualenv).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
