"""Which of a script's imports the warm fork server imports ahead of the workers
(:mod:`kelastic.agent.warmimports`): read from real files with ``ast``, looked up on the
real import path, and never executed."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from kelastic.agent.warmimports import (
    MAX_SCRIPT_BYTES,
    imports_anywhere,
    script_imports,
    script_uses,
    top_level_imports,
)

SCRIPT = textwrap.dedent(
    """
    '''A training script.'''
    from __future__ import annotations

    import json, os.path as osp
    import email.mime.text
    from collections import abc
    from . import sibling
    from .pkg import thing
    import helper
    from helperpkg.sub import f

    try:
        import tomllib
    except ImportError:
        import wave
    else:
        import zlib
    finally:
        import gzip

    import nosuchmodule_kelastic

    def train():
        import csv

    class Model:
        import bz2

    if __name__ == "__main__":
        import lzma

    with open(__file__):
        import shelve

    for _ in range(1):
        import sqlite3
    """
)


def _job(tmp_path: Path, source: str = SCRIPT) -> Path:
    job = tmp_path / "job"
    (job / "helperpkg").mkdir(parents=True)
    (job / "helper.py").write_text("raise SystemExit('never imported')\n")
    (job / "helperpkg" / "__init__.py").write_text("raise SystemExit('never imported')\n")
    (job / "helperpkg" / "sub.py").write_text("def f(): pass\n")
    script = job / "train.py"
    script.write_text(source)
    return script


def test_module_level_imports_in_order_and_try_blocks_kept() -> None:
    assert top_level_imports(SCRIPT) == [
        "json",
        "os.path",
        "email.mime.text",
        "collections",
        "helper",
        "helperpkg.sub",
        "tomllib",
        "wave",
        "zlib",
        "gzip",
        "nosuchmodule_kelastic",
    ]


def test_installed_modules_only_not_the_scripts_own_nor_missing_ones(tmp_path: Path) -> None:
    script = _job(tmp_path)
    expected = ["json", "os.path", "email.mime.text", "collections", "tomllib", "wave", "zlib", "gzip"]
    # Run from anywhere: the script's folder decides what is its own.
    assert script_imports(str(script), cwd=str(tmp_path)) == expected
    assert script_imports("train.py", cwd=str(script.parent)) == expected
    assert script_imports("job/train.py", cwd=str(tmp_path), exclude=("json", "gzip"), limit=3) == [
        "os.path",
        "email.mime.text",
        "collections",
    ]
    # Nothing the script would import was imported to decide.
    assert "helper" not in sys.modules and "helperpkg" not in sys.modules


def test_an_installed_package_shadowed_by_a_file_next_to_the_script_is_the_scripts(tmp_path: Path) -> None:
    script = _job(tmp_path, "import json\nimport gzip\n")
    (script.parent / "json.py").write_text("raise SystemExit('never imported')\n")
    assert script_imports(str(script)) == ["gzip"]


def test_a_module_run_with_dash_m_reads_its_file_and_leaves_out_its_own_package(tmp_path: Path) -> None:
    job = tmp_path / "job"
    (job / "mypkg").mkdir(parents=True)
    (job / "mypkg" / "__init__.py").write_text("raise SystemExit('never imported')\n")
    (job / "mypkg" / "train.py").write_text(
        "import gzip\nimport mypkg.data\nfrom mypkg import util\nimport local\n"
    )
    (job / "mypkg" / "__main__.py").write_text("import zlib\n")
    (job / "local.py").write_text("")
    assert script_imports("mypkg.train", module=True, cwd=str(job)) == ["gzip"]
    assert script_imports("mypkg", module=True, cwd=str(job)) == ["zlib"]
    assert "mypkg" not in sys.modules
    assert script_imports("mypkg.nothing", module=True, cwd=str(job)) == []
    assert script_imports("nosuchpkg_kelastic.train", module=True, cwd=str(job)) == []
    assert script_imports("..", module=True, cwd=str(job)) == []


@pytest.mark.parametrize(
    "source",
    [
        "import json\ndef broken(:\n",  # does not parse
        "import json\nx = '\0'\n",  # a NUL: ast refuses it (ValueError on older Pythons)
        "import json\n" + "(" * 10_000 + ")" * 10_000 + "\n",  # too deep for the parser
    ],
    ids=["syntax-error", "nul", "too-deep"],
)
def test_a_script_that_does_not_parse_gives_nothing(tmp_path: Path, source: str) -> None:
    script = _job(tmp_path, source)
    assert script_imports(str(script)) == []


def test_a_script_that_cannot_be_read_gives_nothing(tmp_path: Path) -> None:
    assert script_imports(str(tmp_path / "missing.py")) == []
    assert script_imports(str(tmp_path)) == []  # a folder
    huge = tmp_path / "huge.py"
    huge.write_bytes(b"import json\n" + b"#" * MAX_SCRIPT_BYTES)
    assert script_imports(str(huge)) == []
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"import json\nname = '\xe9'\n")  # not UTF-8: python refuses it too
    assert script_imports(str(latin)) == []
    latin.write_bytes(b"# -*- coding: latin-1 -*-\nimport json\nname = '\xe9'\n")
    assert script_imports(str(latin)) == ["json"]


@pytest.mark.parametrize(
    ("source", "uses"),
    [
        ("import kelastic.inprocess\n", True),
        ("import kelastic.inprocess as kip\n", True),
        ("from kelastic import inprocess\n", True),
        ("from kelastic.inprocess import run\n", True),
        ("def main():\n    from kelastic.inprocess import run\n", True),  # inside a function
        ("import kelastic\n", False),  # the package alone does not name it
        ("from kelastic import agent\n", False),
        ("import kelastic.inprocessing\n", False),  # a longer name is another module
        ("from .kelastic import inprocess\n", False),  # relative: the script's own package
        ("s = 'import kelastic.inprocess'\n", False),  # in a string only
        ("import kelastic.inprocess\ndef broken(:\n", False),  # does not parse
    ],
)
def test_whether_a_script_imports_a_module_anywhere(source: str, uses: bool) -> None:
    assert imports_anywhere(source, "kelastic.inprocess") is uses


def test_script_uses_reads_the_file_relative_to_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("def main():\n    import kelastic.inprocess\n")
    assert script_uses("train.py", "kelastic.inprocess", cwd=str(tmp_path))
    assert not script_uses("missing.py", "kelastic.inprocess", cwd=str(tmp_path))
    huge = tmp_path / "huge.py"
    huge.write_bytes(b"import kelastic.inprocess\n" + b"#" * MAX_SCRIPT_BYTES)
    assert not script_uses(str(huge), "kelastic.inprocess")
