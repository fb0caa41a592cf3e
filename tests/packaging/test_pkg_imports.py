"""The three parts of kelastic import each other in one direction only.

* ``kelastic.agent`` imports nothing else of ours: it runs in every training pod, beside the
  user's script, and must not pull in the operator's or the local cluster's dependencies.
* ``kelastic.operator`` imports from the agent only its contract with the agent
  (``kelastic.agent.contract``) and the rendezvous store's control records
  (``kelastic.agent.rendezvous.control``).
* ``kelastic.localcluster`` imports neither: it is a Kubernetes stand-in and knows no
  ElasticJob.

Inside ``kelastic.localcluster`` the same holds between its parts (:data:`LOCALCLUSTER`):
``common`` (the API client and shared helpers) imports no other part; the API server
emulator (``apiserver``), the kubelet (``kubelet``), the controllers beside it
(``controllers``) and the real control plane's runner (``controlplane``) import only
``common``, so the kubelet reaches any API server through the client, never the
emulator's registry, and the emulator knows nothing of the kubelet; ``cli`` (the command
and ``LocalCluster``) composes them all. The package's own modules (its ``__init__``,
``__main__`` and ``testing``) may import every part; no part imports them back.

The imports are read from the source with ``ast`` (every ``import`` statement, also inside
functions and ``TYPE_CHECKING`` blocks), so a breach fails here before anything runs.
``make import-rules`` (part of ``make lint``) runs this module alone.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# folder on disk -> its installed package name (pyproject.toml [tool.setuptools] package-dir)
PARTS = {"agent": "kelastic.agent", "operator": "kelastic.operator", "localcluster": "kelastic.localcluster"}

LC = "kelastic.localcluster"
# The parts of the local cluster, each a subpackage, and what each may import of the others.
LOCALCLUSTER: dict[str, tuple[str, ...]] = {
    f"{LC}.common": (),
    f"{LC}.apiserver": (f"{LC}.common",),
    f"{LC}.kubelet": (f"{LC}.common",),
    f"{LC}.controllers": (f"{LC}.common",),
    f"{LC}.controlplane": (f"{LC}.common",),
    f"{LC}.kueue": (f"{LC}.common", f"{LC}.controlplane"),
    f"{LC}.node": (f"{LC}.common", f"{LC}.controlplane"),
    f"{LC}.cli": (
        f"{LC}.common",
        f"{LC}.apiserver",
        f"{LC}.kubelet",
        f"{LC}.controllers",
        f"{LC}.controlplane",
        f"{LC}.kueue",
        f"{LC}.node",
    ),
}
# The modules that stand in localcluster/ itself, outside the parts: the package's public face.
LOCALCLUSTER_OWN = {"__init__.py", "__main__.py", "testing.py"}

# What each part may import of kelastic beyond itself (a module or a package and its modules).
# A module belongs to the longest part its name falls under (kelastic.localcluster.kubelet.x
# to kelastic.localcluster.kubelet, kelastic.localcluster.testing to kelastic.localcluster).
ALLOWED: dict[str, tuple[str, ...]] = {
    "kelastic.agent": (),
    "kelastic.operator": ("kelastic.agent.contract", "kelastic.agent.rendezvous.control"),
    LC: tuple(LOCALCLUSTER),
    **LOCALCLUSTER,
}


def module_name(rel: Path) -> str:
    """Installed dotted name of a source file (``operator/spec.py`` -> ``kelastic.operator.spec``)."""
    parts = list(rel.with_suffix("").parts)
    parts[0] = PARTS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(rel: Path, source: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every kelastic import in a file, relative ones resolved.

    ``from x import y`` yields ``x.y``: y may be a module of package x, and a name defined in
    module x still falls under x by prefix.
    """
    own = module_name(rel)
    package = own if rel.name == "__init__.py" else own.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, filename=str(rel))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kelastic")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] == "kelastic":
                yield from ((node.lineno, f"{base}.{a.name}") for a in node.names)


# Installed names whose source lives inside another part's folder (pyproject.toml package-dir):
# kelastic.checkpoint and kelastic.data are the agent's (agent/public/).
ALIASES = {"kelastic.checkpoint": "kelastic.agent", "kelastic.data": "kelastic.agent"}


def part_of(module: str) -> str | None:
    alias = next((part for name, part in ALIASES.items() if within(module, name)), None)
    return alias or max((p for p in ALLOWED if within(module, p)), key=len, default=None)


def within(module: str, allowed: str) -> bool:
    return module == allowed or module.startswith(allowed + ".")


def breaches(sources: Iterable[tuple[Path, str]]) -> list[str]:
    """One line per forbidden import, ``path:line: part imports module``."""
    found = []
    for rel, source in sources:
        own = part_of(module_name(rel))
        assert own is not None, rel
        for line, target in imports_of(rel, source):
            other = part_of(target)
            if other is None or other == own or any(within(target, ok) for ok in ALLOWED[own]):
                continue
            found.append(f"{rel}:{line}: {own} imports {target}")
    return found


def repository_sources() -> list[tuple[Path, str]]:
    return [
        (path.relative_to(ROOT), path.read_text())
        for folder in PARTS
        for path in sorted((ROOT / folder).rglob("*.py"))
    ]


def test_parts_import_each_other_in_one_direction_only() -> None:
    found = breaches(repository_sources())
    assert not found, (
        "imports across kelastic's parts that the layering forbids (see docs/architecture.md):\n  "
        + "\n  ".join(found)
        + "\nMove what both sides need into kelastic.agent.contract (inside the local cluster:"
        + " into kelastic.localcluster.common), or keep it on one side."
    )


def test_every_module_of_the_local_cluster_is_in_a_part() -> None:
    """A module added to localcluster/ itself would stand outside every part's rule."""
    stray = sorted(
        path.name for path in (ROOT / "localcluster").glob("*.py") if path.name not in LOCALCLUSTER_OWN
    )
    folders = {p.name for p in (ROOT / "localcluster").iterdir() if (p / "__init__.py").is_file()}
    assert not stray, f"put these modules of localcluster/ into one of its parts: {stray}"
    assert folders == {name.rpartition(".")[2] for name in LOCALCLUSTER}, folders


def test_the_reader_sees_the_local_clusters_parts() -> None:
    """Guards the sub-part rule: the CLI's imports of the others are seen and fall under them."""
    seen = {
        part_of(target)
        for rel, source in repository_sources()
        if rel.parts[:2] == ("localcluster", "cli")
        for _, target in imports_of(rel, source)
    }
    assert set(LOCALCLUSTER) - {f"{LC}.cli"} <= seen, seen


def test_the_reader_sees_the_operators_use_of_the_contract() -> None:
    """Guards the reader itself: a rule that sees no import at all would pass vacuously."""
    seen = {
        target
        for rel, source in repository_sources()
        if rel.parts[0] == "operator"
        for _, target in imports_of(rel, source)
    }
    assert any(within(t, "kelastic.agent.contract") for t in seen), seen


@pytest.mark.parametrize(
    ("importer", "source", "expected"),
    [
        (
            "agent/x.py",
            "from kelastic.operator import spec\n",
            "kelastic.agent imports kelastic.operator.spec",
        ),
        (
            "localcluster/x.py",
            "import kelastic.agent.api\n",
            "kelastic.localcluster imports kelastic.agent.api",
        ),
        (
            "operator/x.py",
            "from ..agent import api\n",
            "operator/x.py:1: kelastic.operator imports kelastic.agent.api",
        ),
        ("operator/x.py", "def f():\n    from kelastic.agent.api import W\n", "x.py:2: kelastic.operator"),
        (
            "operator/x.py",
            "from kelastic.localcluster import client\n",
            "imports kelastic.localcluster.client",
        ),
        ("operator/x.py", "from kelastic.agent.contract import LABEL\n", None),
        ("operator/x.py", "from kelastic.agent.rendezvous.control import AgentReport\n", None),
        ("operator/sub/__init__.py", "from .. import spec\n", None),
        ("agent/x.py", "from .rendezvous import handler\nimport torch\n", None),
        ("agent/public/data/__init__.py", "from kelastic.agent.data import *\n", None),
        ("operator/x.py", "from kelastic.checkpoint import MemoryWriter\n", "imports kelastic.checkpoint"),
        # inside the local cluster
        (
            "localcluster/kubelet/x.py",
            "from ..apiserver.registry import Registry\n",
            "kubelet/x.py:1: kelastic.localcluster.kubelet imports kelastic.localcluster.apiserver.registry",
        ),
        (
            "localcluster/kubelet/x.py",
            "def f():\n    from kelastic.localcluster.apiserver import apiserver\n",
            "x.py:2: kelastic.localcluster.kubelet imports kelastic.localcluster.apiserver.apiserver",
        ),
        (
            "localcluster/kubelet/x.py",
            "from .. import LocalCluster\n",
            "imports kelastic.localcluster.LocalCluster",
        ),
        ("localcluster/apiserver/x.py", "from ..kubelet import kubelet\n", "apiserver imports"),
        ("localcluster/controllers/x.py", "from ..cli.cluster import LocalCluster\n", "imports"),
        ("localcluster/common/x.py", "from ..apiserver.errors import ApiError\n", "common imports"),
        ("localcluster/controlplane/x.py", "from kelastic.localcluster import testing\n", "imports"),
        (
            "localcluster/kubelet/x.py",
            "from kelastic.operator import spec\n",
            "kubelet imports kelastic.operator",
        ),
        (
            "agent/x.py",
            "from kelastic.localcluster.common import client\n",
            "agent imports kelastic.localcluster",
        ),
        ("localcluster/kubelet/x.py", "from ..common.client import ApiClient\nfrom . import podenv\n", None),
        ("localcluster/apiserver/x.py", "from . import registry\nfrom ..common import ipam\n", None),
        (
            "localcluster/cli/x.py",
            "from ..apiserver.apiserver import ApiServer\nfrom ..kubelet import kubelet\n",
            None,
        ),
        ("localcluster/testing.py", "from kelastic.localcluster.cli.cluster import LocalCluster\n", None),
        ("localcluster/__init__.py", "from .kubelet.kubelet import Kubelet\n", None),
    ],
)
def test_the_rule_catches_planted_breaches(importer: str, source: str, expected: str | None) -> None:
    """The rule fails on a planted breach, wherever in the file the import stands."""
    found = breaches([(Path(importer), source)])
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found


#: The most lines a class of the agent or the operator may span: past it, a class holds
#: more than one concern and wants splitting (the agent's rendezvous handler and monitor
#: loop were split along these lines).
MAX_CLASS_LINES = 500


def test_no_class_of_the_agent_or_the_operator_is_over_the_limit() -> None:
    too_long = [
        f"{path.relative_to(ROOT)}: {node.name} spans {node.end_lineno - node.lineno + 1} lines"
        for folder in ("agent", "operator")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not too_long, f"classes over {MAX_CLASS_LINES} lines: {too_long}"
