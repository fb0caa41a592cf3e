"""The agent's import path needs only the standard library and torch (NumPy through torch).

Worker images get the agent injected (``spec.agent: inject``) and have nothing but
Python and torch: importing kopf, kubernetes, aiohttp or PyYAML anywhere on the
agent's path would break every such job. A fresh interpreter whose import system
refuses those packages imports every module of ``kelastic.agent``. (The slow
``test_agent_inject.py`` runs a whole job in an environment without them.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCKED = ("kopf", "kubernetes", "aiohttp", "yaml")

PROGRAM = f"""
import importlib, importlib.abc, pkgutil, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is not available in a worker image")
        return None

sys.meta_path.insert(0, Refuse())
import kelastic.agent
found = pkgutil.walk_packages(kelastic.agent.__path__, "kelastic.agent.")
# __main__ modules run their program when imported; what they import is imported here anyway.
names = sorted(m.name for m in found if not m.name.endswith(".__main__"))
for name in names:
    importlib.import_module(name)
print(len(names), "modules")
"""


@pytest.mark.slow
def test_every_agent_module_imports_without_the_operators_dependencies() -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[0]) > 20, proc.stdout


def test_the_blocker_does_block() -> None:
    """The guard above is real: the same interpreter setup fails on a blocked import."""
    program = PROGRAM.replace("import kelastic.agent\n", "import yaml\nimport kelastic.agent\n", 1)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "yaml is not available in a worker image" in proc.stderr
