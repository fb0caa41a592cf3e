"""``kelastic`` without the ``local`` extra (as in the operator's image): the command says which
extra to install instead of failing on an import, and importing the package needs none of it."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Makes ``import NAME`` fail in the child, as it does where the distribution is not installed.
WITHOUT = "import sys\nfor name in {names!r}: sys.modules[name] = None\n"


def run(names: list[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT.format(names=names) + code],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "entry",
    [
        "from kelastic.localcluster.cli import main; sys.exit(main(['local', 'up']))",
        "import runpy; sys.argv = ['kelastic', 'local', 'up']; runpy.run_module('kelastic.localcluster', run_name='__main__')",
    ],
)
def test_the_command_names_the_extra_to_install(entry: str) -> None:
    done = run(["cryptography"], entry)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert (
        "kelastic local needs the 'local' extra" in done.stderr and "(missing: cryptography)" in done.stderr
    )
    assert "pip install 'kelastic[local]'" in done.stderr and "pip install -e '.[local]'" in done.stderr


def test_every_missing_distribution_is_named() -> None:
    done = run(["cryptography", "yaml"], "from kelastic.localcluster.cli import main; sys.exit(main([]))")
    assert done.returncode == 1 and "(missing: pyyaml, cryptography)" in done.stderr, done.stderr


def test_importing_the_package_needs_nothing_of_the_extra() -> None:
    done = run(["cryptography", "yaml", "aiohttp"], "import kelastic.localcluster; print('imported')")
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr


def test_the_public_names_load_when_used() -> None:
    done = run(
        [], "import kelastic.localcluster as lc; print(lc.LocalCluster.__name__, lc.DEFAULT_NODE_NAME)"
    )
    assert done.returncode == 0 and done.stdout.split() == ["LocalCluster", "kelastic-local"], done.stderr
    done = run([], "import kelastic.localcluster as lc; lc.Nothing")
    assert done.returncode == 1 and "has no attribute 'Nothing'" in done.stderr
