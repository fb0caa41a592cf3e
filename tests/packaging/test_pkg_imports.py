"""The three parts of kelastic import each other in one direction only.

* ``kelastic.agent`` imports nothing else of ours: it runs in every training pod, beside the
  user's script, and must not pull in the operator's or the local cluster's dependencies.
* ``kelastic.operator`` imports from the agent only its contract with the agent
  (``kelastic.agent.contract``), the rendezvous store's control records
  (``kelastic.agent.rendezvous.control``) and the straggler rule both write and read
  (``kelastic.agent.stragglerrule``).
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

Within a part, modules import each other without a circle: a type two modules share lives
in a module below both (:func:`circles`, over the same imports).

The imports are read from the source with ``ast`` (every ``import`` statement, also inside
functions and ``TYPE_CHECKING`` blocks), so a breach fails here before anything runs.
``make import-rules`` (part of ``make lint``) runs this module alone, and with it the rules
on size: no class of the three parts over :data:`MAX_CLASS_LINES` lines, no function over
:data:`MAX_FUNCTION_LINES` (docstrings not counted; argument parsers excepted by name).
"""

from __future__ import annotations

import ast
import functools
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
    "kelastic.operator": (
        "kelastic.agent.contract",
        "kelastic.agent.rendezvous.control",
        "kelastic.agent.stragglerrule",
    ),
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
    return iter(_imports(rel, source))


@functools.cache
def _imports(rel: Path, source: str) -> tuple[tuple[int, str], ...]:
    """:func:`imports_of`, each file parsed once per session (every rule here reads them all)."""
    return tuple(_read_imports(rel, source))


def _read_imports(rel: Path, source: str) -> Iterator[tuple[int, str]]:
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
# kelastic.checkpoint, kelastic.data and kelastic.inprocess are the agent's (agent/public/).
ALIASES = {
    "kelastic.checkpoint": "kelastic.agent",
    "kelastic.data": "kelastic.agent",
    "kelastic.inprocess": "kelastic.agent",
}


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


@functools.cache
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


# --- no import circles ---------------------------------------------------------------------------

#: Import circles still being untangled, each as the sorted modules that form it. Nothing may
#: be added here: a circle is broken by moving what both sides need into a module below them.
KNOWN_CIRCLES: tuple[tuple[str, ...], ...] = ()


def import_graph(sources: Iterable[tuple[Path, str]]) -> dict[str, dict[str, str]]:
    """``{module: {module it imports: "path:line"}}`` over kelastic's own modules.

    An import names the longest module it falls under (``from .api import Foo`` is an import
    of ``api``; ``from . import api`` of ``api`` too, and of the package only when no such
    module exists), through :data:`ALIASES`' installed names.
    """
    sources = list(sources)
    modules = {module_name(rel) for rel, _ in sources}
    # kelastic.checkpoint -> kelastic.agent.public.checkpoint (pyproject.toml package-dir)
    aliases = {
        "kelastic.checkpoint": "kelastic.agent.public.checkpoint",
        "kelastic.data": "kelastic.agent.public.data",
        "kelastic.inprocess": "kelastic.agent.public.inprocess",
    }

    def resolve(target: str) -> str | None:
        for name, real in aliases.items():
            if within(target, name):
                target = real + target[len(name) :]
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, dict[str, str]] = {}
    for rel, source in sources:
        own = module_name(rel)
        edges = graph.setdefault(own, {})
        for line, target in imports_of(rel, source):
            other = resolve(target)
            if other is not None and other != own:
                edges.setdefault(other, f"{rel}:{line}")
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[tuple[str, ...]]:
    """The import circles of ``graph``: its strongly connected sets of two or more modules,
    each sorted (Tarjan's algorithm, iterative: no recursion limit on a deep chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next((c for c in edges if c not in index or c in on_stack), None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        found.append(tuple(sorted(members)))
            elif child in index:
                low[node] = min(low[node], index[child])
            else:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, {})))))
    return sorted(found)


def describe(circle: tuple[str, ...], graph: dict[str, dict[str, str]]) -> str:
    """The imports that close a circle, one ``path:line: a imports b`` each."""
    return "; ".join(
        f"{where}: {a} imports {b}" for a in circle for b, where in sorted(graph[a].items()) if b in circle
    )


def test_no_module_of_kelastic_is_in_an_import_circle() -> None:
    graph = import_graph(repository_sources())
    found = [c for c in circles(graph) if c not in KNOWN_CIRCLES]
    assert not found, (
        "import circles (imports inside functions and under TYPE_CHECKING count):\n  "
        + "\n  ".join(describe(c, graph) for c in found)
        + "\nMove what both sides need into a module that both import and that imports neither."
    )


def test_the_known_circles_are_still_there() -> None:
    """An entry of :data:`KNOWN_CIRCLES` that no longer exists is removed, so none comes back."""
    present = set(circles(import_graph(repository_sources())))
    gone = [c for c in KNOWN_CIRCLES if c not in present]
    assert not gone, f"these circles are broken now: remove them from KNOWN_CIRCLES: {gone}"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # at run time, through a function's import
        (
            {"agent/a.py": "from . import b\n", "agent/b.py": "def f():\n    from .a import X\n"},
            [("kelastic.agent.a", "kelastic.agent.b")],
        ),
        # only for the type checker
        (
            {
                "agent/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import Y\n",
                "agent/b.py": "from kelastic.agent.a import X\n",
            },
            [("kelastic.agent.a", "kelastic.agent.b")],
        ),
        # three modules round, beside a module that is in none
        (
            {
                "agent/p/__init__.py": "",
                "agent/p/a.py": "from .b import X\n",
                "agent/p/b.py": "from .c import Y\n",
                "agent/p/c.py": "from kelastic.agent.p.a import Z\nfrom kelastic.agent import d\n",
                "agent/d.py": "",
            },
            [("kelastic.agent.p.a", "kelastic.agent.p.b", "kelastic.agent.p.c")],
        ),
        # a shared type moved below both: no circle
        (
            {
                "agent/a.py": "from .types import T\nfrom . import b\n",
                "agent/b.py": "from .types import T\n",
                "agent/types.py": "",
            },
            [],
        ),
        # a package that re-exports its modules, which import each other: no circle
        (
            {
                "agent/p/__init__.py": "from .a import X\nfrom .b import Y\n",
                "agent/p/a.py": "from .b import Y\n",
                "agent/p/b.py": "import os\n",
            },
            [],
        ),
    ],
)
def test_the_circle_check_finds_planted_circles(
    files: dict[str, str], expected: list[tuple[str, ...]]
) -> None:
    assert circles(import_graph((Path(path), source) for path, source in files.items())) == expected


#: The most lines a class of any of the three parts may span: past it, a class holds more
#: than one concern and wants splitting (the agent's rendezvous handler and monitor loop,
#: the local cluster's registry, kubelet and HTTP handlers were split along these lines).
MAX_CLASS_LINES = 500
#: The most lines a function may span, its docstring not counted (a contract a reader wants
#: whole): past it, a function does several things, each of which wants a name.
MAX_FUNCTION_LINES = 100
#: Argument parsers: one ``add_argument`` after another, as long as the flags are many.
ARGUMENT_PARSERS = frozenset(
    {
        "agent/cli.py:build_parser",
        "agent/cli.py:config_from_args",
        "operator/cli.py:build_parser",
    }
)
#: Longer functions whose split is under way on other branches; each entry goes when its
#: function is within the limit (the test below then says so).
BEING_SPLIT: frozenset[str] = frozenset()


def _spans(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every class and function under ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            yield name, child
            yield from _spans(child, name + ".")
        else:
            yield from _spans(child, prefix)


def _lines(node: ast.AST, without_docstring: bool = False) -> int:
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    body = getattr(node, "body", [])
    if without_docstring and body and isinstance(body[0], ast.Expr):
        value = body[0].value
        if (
            isinstance(value, ast.Constant)
            and isinstance(value.value, str)
            and body[0].end_lineno is not None
        ):
            lines -= body[0].end_lineno - body[0].lineno + 1
    return lines


def measured(kind: type[ast.AST] | tuple[type[ast.AST], ...]) -> dict[str, ast.AST]:
    """``path:qualified.name`` → node of every class or function of the three parts."""
    return {
        f"{path.relative_to(ROOT)}:{name}": node
        for folder in PARTS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name, node in _spans(ast.parse(path.read_text()))
        if isinstance(node, kind)
    }


def test_no_class_is_over_the_limit() -> None:
    too_long = [
        f"{where} spans {_lines(node)} lines"
        for where, node in measured(ast.ClassDef).items()
        if _lines(node) > MAX_CLASS_LINES
    ]
    assert not too_long, f"classes over {MAX_CLASS_LINES} lines (split them along their seams): {too_long}"


def test_no_function_is_over_the_limit() -> None:
    functions = measured((ast.FunctionDef, ast.AsyncFunctionDef))
    too_long = [
        f"{where} spans {_lines(node, without_docstring=True)} lines"
        for where, node in functions.items()
        if _lines(node, without_docstring=True) > MAX_FUNCTION_LINES
        and where not in ARGUMENT_PARSERS | BEING_SPLIT
    ]
    assert not too_long, (
        f"functions over {MAX_FUNCTION_LINES} lines, docstrings not counted (give each of their steps a "
        f"name; an argument parser goes into ARGUMENT_PARSERS): {too_long}"
    )
    stale = sorted(
        where
        for where in BEING_SPLIT
        if where not in functions or _lines(functions[where], without_docstring=True) <= MAX_FUNCTION_LINES
    )
    assert not stale, f"within the limit or gone now: remove them from BEING_SPLIT: {stale}"
    missing = sorted(ARGUMENT_PARSERS - functions.keys())
    assert not missing, f"no such functions: remove them from ARGUMENT_PARSERS: {missing}"


def test_the_size_rules_see_methods_and_nested_functions() -> None:
    """Guards the measure itself: a method is named by its class, a docstring is not counted."""
    source = 'class A:\n    def f(self):\n        """Doc\n        string."""\n        return 1\n'
    spans = dict(_spans(ast.parse(source)))
    assert set(spans) == {"A", "A.f"}
    assert (_lines(spans["A"]), _lines(spans["A.f"]), _lines(spans["A.f"], without_docstring=True)) == (
        5,
        4,
        2,
    )
