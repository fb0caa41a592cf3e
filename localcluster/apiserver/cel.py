"""A subset of CEL for CRD validation rules (``x-kubernetes-validations``).

Supported: literals (int, double, string, bool, null, lists, maps), ``self`` and
``oldSelf``, field selection and indexing, ``has()``, arithmetic, comparisons,
``in``, ``&&``/``||``/``!``, the conditional ``?:``, ``size``, string
``startsWith``/``endsWith``/``contains``/``matches``/``lowerAscii``/``upperAscii``,
``format`` (``%s``, ``%d``, ``%f`` and ``%%``), ``int``/``double``/``string`` conversions, an optional ``oldSelf``
(:class:`Optional`: ``hasValue``/``value``/``orValue``) and the ``all``/``exists``/
``exists_one``/``map``/``filter`` macros. :func:`compile_rule` raises
:class:`CelError` for anything else; callers then leave that rule unenforced
rather than refuse objects for a rule the server cannot read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["MISSING", "CelError", "Optional", "compile_rule", "evaluate"]


class CelError(Exception):
    """A rule that cannot be parsed or evaluated."""


#: A value that is not there (a field the old object lacks, ``oldSelf`` on create).
MISSING = object()


_TOKEN = re.compile(
    r"""\s*(?:
    (?P<num>\d+\.\d+(?:[eE][+-]?\d+)?|\d+[uU]?)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<op>&&|\|\||==|!=|<=|>=|[-+*/%<>!?:.,()\[\]{}])
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)


def _tokenize(src: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos = 0
    src = src.strip()
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise CelError(f"cannot read {src[pos : pos + 10]!r}")
        pos = m.end()
        if m.group("num") is not None:
            text = m.group("num").rstrip("uU")
            out.append(("lit", float(text) if "." in text else int(text)))
        elif m.group("str") is not None:
            body = m.group("str")[1:-1]
            out.append(("lit", bytes(body, "utf-8").decode("unicode_escape")))
        elif m.group("op") is not None:
            out.append(("op", m.group("op")))
        else:
            name = m.group("id")
            if name in ("true", "false"):
                out.append(("lit", name == "true"))
            elif name == "null":
                out.append(("lit", None))
            elif name == "in":
                out.append(("op", "in"))
            else:
                out.append(("id", name))
    out.append(("end", None))
    return out


@dataclass(frozen=True)
class Optional:
    """A CEL optional: ``oldSelf`` of a rule with ``optionalOldSelf`` (empty on create)."""

    held: Any

    def has_value(self) -> bool:
        return self.held is not MISSING

    def value(self) -> Any:
        if self.held is MISSING:
            raise CelError("optional.none() dereference")
        return self.held


Env = dict[str, Any]
Node = Callable[[Env], Any]
_MISSING = MISSING


@dataclass
class _Parser:
    toks: list[tuple[str, Any]]
    i: int = 0

    def peek(self) -> tuple[str, Any]:
        return self.toks[self.i]

    def take(self, op: str | None = None) -> tuple[str, Any]:
        tok = self.toks[self.i]
        if op is not None and tok != ("op", op):
            raise CelError(f"expected {op!r}, found {tok[1]!r}")
        self.i += 1
        return tok

    def at(self, op: str) -> bool:
        return self.peek() == ("op", op)

    def expr(self) -> Node:
        cond = self.or_()
        if self.at("?"):
            self.take("?")
            yes = self.expr()
            self.take(":")
            no = self.expr()
            return lambda env: yes(env) if _truth(cond(env)) else no(env)
        return cond

    def or_(self) -> Node:
        left = self.and_()
        while self.at("||"):
            self.take()
            right = self.and_()
            left = (lambda a, b: lambda env: _truth(a(env)) or _truth(b(env)))(left, right)
        return left

    def and_(self) -> Node:
        left = self.rel()
        while self.at("&&"):
            self.take()
            right = self.rel()
            left = (lambda a, b: lambda env: _truth(a(env)) and _truth(b(env)))(left, right)
        return left

    def rel(self) -> Node:
        left = self.add()
        ops = {
            "==": lambda a, b: a == b,
            "!=": lambda a, b: a != b,
            "<": lambda a, b: a < b,
            "<=": lambda a, b: a <= b,
            ">": lambda a, b: a > b,
            ">=": lambda a, b: a >= b,
            "in": lambda a, b: a in b,
        }
        while self.peek()[0] == "op" and self.peek()[1] in ops:
            fn = ops[self.take()[1]]
            right = self.add()
            left = (lambda f, a, b: lambda env: f(a(env), b(env)))(fn, left, right)
        return left

    def add(self) -> Node:
        left = self.mul()
        while self.at("+") or self.at("-"):
            op = self.take()[1]
            right = self.mul()
            left = _binary(op, left, right)
        return left

    def mul(self) -> Node:
        left = self.unary()
        while self.at("*") or self.at("/") or self.at("%"):
            op = self.take()[1]
            right = self.unary()
            left = _binary(op, left, right)
        return left

    def unary(self) -> Node:
        if self.at("!"):
            self.take()
            inner = self.unary()
            return lambda env: not _truth(inner(env))
        if self.at("-"):
            self.take()
            inner = self.unary()
            return lambda env: -inner(env)
        return self.postfix()

    def postfix(self) -> Node:
        node = self.primary()
        while True:
            if self.at("."):
                self.take()
                kind, name = self.take()
                if kind != "id":
                    raise CelError(f"expected a field name after '.', found {name!r}")
                if self.at("("):
                    node = self.method(node, name)
                else:
                    node = (lambda n, k: lambda env: _select(n(env), k))(node, name)
            elif self.at("["):
                self.take()
                idx = self.expr()
                self.take("]")
                node = (lambda n, i: lambda env: _index(n(env), i(env)))(node, idx)
            else:
                return node

    def args(self) -> list[Node]:
        self.take("(")
        out: list[Node] = []
        while not self.at(")"):
            out.append(self.expr())
            if not self.at(")"):
                self.take(",")
        self.take(")")
        return out

    def method(self, target: Node, name: str) -> Node:
        if name in ("all", "exists", "exists_one", "map", "filter"):
            self.take("(")
            kind, var = self.take()
            if kind != "id":
                raise CelError(f"{name}() needs a variable name")
            self.take(",")
            body = self.expr()
            self.take(")")
            return _macro(name, target, var, body)
        args = self.args()
        fns: dict[str, Callable[..., Any]] = {
            "size": lambda t: len(t),
            "startsWith": lambda t, s: t.startswith(s),
            "endsWith": lambda t, s: t.endswith(s),
            "contains": lambda t, s: s in t,
            "matches": lambda t, s: re.search(s, t) is not None,
            "lowerAscii": lambda t: t.lower(),
            "upperAscii": lambda t: t.upper(),
            "format": _format,
            "hasValue": lambda t: _optional(t).has_value(),
            "value": lambda t: _optional(t).value(),
            "orValue": lambda t, other: _optional(t).value() if _optional(t).has_value() else other,
        }
        if name not in fns:
            raise CelError(f"unsupported method {name}()")
        fn = fns[name]
        return lambda env: fn(target(env), *(a(env) for a in args))

    def primary(self) -> Node:
        kind, value = self.take()
        if kind == "lit":
            return lambda env: value
        if kind == "op" and value == "(":
            inner = self.expr()
            self.take(")")
            return inner
        if kind == "op" and value == "[":
            items: list[Node] = []
            while not self.at("]"):
                items.append(self.expr())
                if not self.at("]"):
                    self.take(",")
            self.take("]")
            return lambda env: [i(env) for i in items]
        if kind == "op" and value == "{":
            pairs: list[tuple[Node, Node]] = []
            while not self.at("}"):
                k = self.expr()
                self.take(":")
                pairs.append((k, self.expr()))
                if not self.at("}"):
                    self.take(",")
            self.take("}")
            return lambda env: {k(env): v(env) for k, v in pairs}
        if kind == "id":
            if self.at("("):
                return self.function(value)
            return lambda env: env[value] if value in env else _fail(f"undeclared reference to {value!r}")
        raise CelError(f"unexpected {value!r}")

    def function(self, name: str) -> Node:
        if name == "has":
            self.take("(")
            start = self.i
            target = self.postfix()
            self.take(")")
            kind, field = self.toks[self.i - 2]
            if self.toks[self.i - 3] != ("op", ".") or kind != "id" or self.i - 3 < start:
                raise CelError("has() needs a field selection like has(self.field)")
            del target  # parsed only to find the selection's end; has() tests its last field
            parent = _Parser([*self.toks[start : self.i - 3], ("end", None)]).postfix()
            return lambda env: isinstance(p := parent(env), dict) and field in p
        args = self.args()
        conv: dict[str, Callable[[Any], Any]] = {
            "size": len,
            "int": int,
            "double": float,
            "string": str,
            "bool": bool,
        }
        if name not in conv or len(args) != 1:
            raise CelError(f"unsupported function {name}()")
        fn = conv[name]
        return lambda env: fn(args[0](env))


_VERB = re.compile(r"%(?:\.(\d+))?([a-z%])")


def _format(template: Any, args: Any) -> str:
    """CEL's ``"...".format([args])`` for ``%s``, ``%d``, ``%f`` (``%.Nf``) and ``%%``."""
    if not isinstance(template, str) or not isinstance(args, list):
        raise CelError("format() is called on a string with a list of arguments")
    values = iter(args)

    def one(m: re.Match[str]) -> str:
        verb = m.group(2)
        if verb == "%":
            return "%"
        try:
            value = next(values)
        except StopIteration:
            raise CelError(f"index {m.start()} out of range") from None
        if verb == "s":
            return _cel_string(value)
        if verb == "d" and isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if verb == "f" and isinstance(value, int | float) and not isinstance(value, bool):
            return f"{float(value):.{int(m.group(1) or 6)}f}"
        raise CelError(f"format: %{verb} does not take {type(value).__name__}")

    return _VERB.sub(one, template)


def _cel_string(value: Any) -> str:
    """A value as CEL's ``string()`` (and ``%s``) writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def _optional(value: Any) -> Optional:
    if not isinstance(value, Optional):
        raise CelError(f"no such overload: {type(value).__name__} is not an optional")
    return value


def _binary(op: str, left: Node, right: Node) -> Node:
    return lambda env: _arith(op, left(env), right(env))


def _fail(msg: str) -> Any:
    raise CelError(msg)


def _truth(v: Any) -> bool:
    if not isinstance(v, bool):
        raise CelError(f"expected a bool, got {type(v).__name__}")
    return v


def _arith(op: str, a: Any, b: Any) -> Any:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0:
            raise CelError("division by zero")
        return a // b if isinstance(a, int) and isinstance(b, int) else a / b
    if b == 0:
        raise CelError("modulus by zero")
    return a % b


def _select(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        if key not in obj:
            raise CelError(f"no such key: {key}")
        return obj[key]
    raise CelError(f"cannot select {key!r} from {type(obj).__name__}")


def _index(obj: Any, key: Any) -> Any:
    try:
        return obj[key]
    except (KeyError, IndexError, TypeError):
        raise CelError(f"no such key: {key}") from None


def _macro(name: str, target: Node, var: str, body: Node) -> Node:
    def run(env: Env) -> Any:
        items = target(env)
        seq = list(items.keys()) if isinstance(items, dict) else list(items)
        results = [body({**env, var: item}) for item in seq] if name != "filter" else None
        if name == "all":
            return all(_truth(r) for r in results or [])
        if name == "exists":
            return any(_truth(r) for r in results or [])
        if name == "exists_one":
            return sum(1 for r in results or [] if _truth(r)) == 1
        if name == "map":
            return results
        return [item for item in seq if _truth(body({**env, var: item}))]

    return run


def compile_rule(rule: str) -> Node:
    """Parse a rule into a callable over an environment (``self``, ``oldSelf``)."""
    parser = _Parser(_tokenize(rule))
    node = parser.expr()
    if parser.peek()[0] != "end":
        raise CelError(f"unexpected {parser.peek()[1]!r} after the expression")
    return node


def evaluate(rule: str, self_value: Any, old_value: Any = _MISSING) -> Any:
    """Evaluate ``rule`` with ``self`` (and ``oldSelf`` when given)."""
    env: Env = {"self": self_value}
    if old_value is not _MISSING:
        env["oldSelf"] = old_value
    try:
        return compile_rule(rule)(env)
    except CelError:
        raise
    except (TypeError, ValueError, re.error, AttributeError) as exc:
        raise CelError(str(exc)) from None
