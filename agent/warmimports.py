"""Which of a training script's imports the warm fork server may import ahead of the workers.

A warm-started worker (:mod:`kelastic.agent.warm`) is a fork of a server that has
imported torch; what the script imports besides (numpy, torchvision, its data
libraries) each worker would still import on every (re)start. :func:`script_imports`
reads the script with :mod:`ast`, without running it, and names the modules the server
can import for it: the absolute imports at the script's module level (also inside a
module-level ``try:``), of modules installed outside the script's own directory (the
standard library and installed packages).

Left out: imports inside functions, classes and ``if`` blocks (``if __name__ ==
"__main__":`` above all: they may never run, or only with the rank's environment),
relative imports, and every module found in the script's directory (or, for ``-m``, the
working directory, and the package being run): the user's own modules may read
``RANK``, open files or initialise CUDA when imported, which the server, with no rank's
environment and before any worker exists, must not do. Nothing is imported to decide:
only top-level names are looked up (``importlib.util.find_spec`` of ``a`` for ``a.b``).
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import cast

__all__ = [
    "LIMIT",
    "MAX_SCRIPT_BYTES",
    "imports_anywhere",
    "module_source",
    "script_imports",
    "script_uses",
    "top_level_imports",
]

#: At most this many modules are named (a script's first ones, in the order it imports them).
LIMIT = 64

#: A script larger than this (bytes) is not read: no script is, and reading it would cost the agent.
MAX_SCRIPT_BYTES = 16 * 1024 * 1024

#: Never worth importing early: no module (``__future__`` is a compiler directive) or the script itself.
_SKIP = frozenset({"__future__", "__main__"})

_TRY: tuple[type, ...] = tuple(t for t in (ast.Try, getattr(ast, "TryStar", None)) if t is not None)


def top_level_imports(source: str | bytes) -> list[str]:
    """The modules ``source`` imports absolutely at its module level, first seen first, once
    each (``import a.b`` and ``from a.b import c`` both name ``a.b``), including those in
    module-level ``try``/``except``/``else``/``finally`` blocks; nothing in functions,
    classes, ``if``, loops or ``with``. SyntaxError (or ValueError) when it does not parse."""
    seen: dict[str, None] = {}
    for name in _imports(ast.parse(source).body):
        if name.split(".")[0] not in _SKIP:
            seen.setdefault(name, None)
    return list(seen)


def _imports(body: Iterable[ast.stmt]) -> Iterator[str]:
    for node in body:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:  # relative imports: the script's own package
                yield node.module
        elif isinstance(node, _TRY):
            node = cast(ast.Try, node)  # ast.TryStar (except*, Python 3.11) has the same fields
            yield from _imports(node.body)
            for handler in node.handlers:
                yield from _imports(handler.body)
            yield from _imports(node.orelse)
            yield from _imports(node.finalbody)


def module_source(module: str, cwd: str) -> str | None:
    """The file ``python -m module`` would run from ``cwd`` (a package's ``__main__.py``),
    found without importing anything (parent packages are looked up, not run), or None."""
    locations: list[str] | None = [cwd, *(p for p in sys.path if p)]
    spec = None
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):
        if locations is None:
            return None  # a parent that is a module, not a package
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), locations)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or []) or None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            main = os.path.join(folder, "__main__.py")
            if os.path.isfile(main):
                return main
        return None
    return spec.origin if spec.origin and os.path.isfile(spec.origin) else None


def script_imports(
    script: str,
    *,
    module: bool = False,
    cwd: str | None = None,
    exclude: Sequence[str] = (),
    limit: int = LIMIT,
) -> list[str]:
    """The modules worth importing before a worker runs ``script`` (a path; with ``module``,
    a module name run from ``cwd`` as ``python -m`` would): :func:`top_level_imports` of
    modules whose top-level package is found, without importing it, outside the script's
    directory (for ``-m``: outside ``cwd``, and not the package being run), minus
    ``exclude``, at most ``limit``. Empty when the script cannot be found, read or parsed
    (or is over :data:`MAX_SCRIPT_BYTES`):
    the workers then run (or fail) exactly as they would without this."""
    cwd = os.path.abspath(cwd or os.getcwd())
    if module:
        try:
            path = module_source(script, cwd)
        except (ImportError, ValueError, OSError):  # not a module name that can be looked up
            path = None
        own = {script.split(".")[0]}  # the package being run is the user's own
        home = cwd
    else:
        path = script
        own = set()
        home = os.path.dirname(os.path.abspath(os.path.join(cwd, script)))
    if path is None:
        return []
    try:
        with open(os.path.join(cwd, path), "rb") as f:
            source = f.read(MAX_SCRIPT_BYTES + 1)
        if len(source) > MAX_SCRIPT_BYTES:
            return []
        names = top_level_imports(source)  # bytes: the parser honours a coding cookie
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    found: dict[str, bool] = {}
    chosen: list[str] = []
    for name in names:
        if len(chosen) >= limit:
            break
        top = name.split(".")[0]
        if name in exclude or top in own:
            continue
        if top not in found:
            found[top] = _installed_elsewhere(top, home)
        if found[top]:
            chosen.append(name)
    return chosen


def _installed_elsewhere(top: str, home: str) -> bool:
    """Whether the top-level module ``top`` is found, and not in the folder ``home``."""
    try:
        if importlib.machinery.PathFinder.find_spec(top, [home]) is not None:
            return False  # the script's own module: first on the worker's sys.path
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError, OSError):
        return False
    if spec is None:
        return False
    places = [spec.origin] if spec.origin and os.path.isabs(spec.origin) else []
    places += list(spec.submodule_search_locations or [])
    return not any(_inside(place, home) for place in places)


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def imports_anywhere(source: str | bytes, module: str) -> bool:
    """Whether ``source`` imports ``module`` (or a name from it) anywhere, inside functions
    too (pure; False when it does not parse)."""
    parent, _, leaf = module.rpartition(".")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
            a.name == module or a.name.startswith(module + ".") for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == module or node.module.startswith(module + "."):
                return True
            if parent and node.module == parent and any(a.name == leaf for a in node.names):
                return True
    return False


def script_uses(script: str, module: str, *, cwd: str | None = None) -> bool:
    """Whether the training script at path ``script`` imports ``module`` anywhere
    (:func:`imports_anywhere`); False when it cannot be read."""
    try:
        with open(os.path.join(os.path.abspath(cwd or os.getcwd()), script), "rb") as f:
            source = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError:
        return False
    return len(source) <= MAX_SCRIPT_BYTES and imports_anywhere(source, module)
