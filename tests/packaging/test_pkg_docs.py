"""docs/architecture.md cannot drift silently: its tables name every module (of the agent and the operator)
and every part (of the local cluster), its command line every flag."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def section(title: str) -> str:
    """The text of the ``## title`` section of docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(title: str) -> set[str]:
    """The modules the first column of the section's table names: ``name.py`` and ``name/``."""
    names: set[str] = set()
    for line in section(title).splitlines():
        if line.startswith("| ") and not line.startswith("| module "):
            first = line.split("|")[1]
            names.update(re.findall(r"`([\w]+(?:\.py|/))`", first))
    return names


def modules(part: str) -> set[str]:
    """The modules of a top-level folder: ``name.py`` files and ``name/`` folders of Python files."""
    found: set[str] = set()
    for path in (ROOT / part).iterdir():
        if path.name.startswith(("_", ".")):
            continue  # __init__.py, __main__.py, caches
        if path.is_file() and path.suffix == ".py":
            found.add(path.name)
        elif path.is_dir() and any(path.rglob("*.py")):
            found.add(f"{path.name}/")
    return found


@pytest.mark.parametrize(
    ("part", "title"),
    [
        ("operator", "Inside the operator"),
        ("agent", "Inside the agent"),
        ("localcluster", "Inside the local cluster"),
    ],
)
def test_every_module_has_a_row_and_every_row_a_module(part: str, title: str) -> None:
    documented, present = table_rows(title), modules(part)
    assert not present - documented, (
        f"modules of {part}/ missing from the table '{title}' of docs/architecture.md"
    )
    assert not documented - present, f"rows of '{title}' in docs/architecture.md name modules {part}/ lacks"


def test_the_worker_command_line_shows_every_flag_the_operator_passes() -> None:
    builders = ast.parse((ROOT / "operator" / "builders.py").read_text())  # agent_command and its helpers
    used = {
        node.attr
        for node in ast.walk(builders)
        if isinstance(node, ast.Attribute) and node.attr.startswith("FLAG_")
    }
    contract = {
        node.targets[0].id: node.value.value
        for node in ast.parse((ROOT / "agent" / "contract.py").read_text()).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }
    text = section("The operator ↔ agent contract")
    command = text[text.index("kelastic-agent --nnodes") :].split("```")[0]
    missing = sorted(
        contract[name] for name in used if not re.search(rf"(?<![\w-]){contract[name]}(?![\w-])", command)
    )
    assert used and not missing, f"the worker command line in docs/architecture.md lacks {missing}"


def test_every_protocol_the_agent_asks_of_a_handler_is_named() -> None:
    api = ast.parse((ROOT / "agent" / "api.py").read_text())
    protocols = {
        node.name
        for node in api.body
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "Protocol" for b in node.bases)
    }
    text = section("The three parts")
    assert protocols and not {p for p in protocols if f"`{p}`" not in text}
