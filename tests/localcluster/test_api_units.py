"""Unit tests of the API server's pure parts: patches, schemas, selectors, JSONPath, protobuf."""

from __future__ import annotations

import pytest

from kelastic.localcluster.apiserver.errors import ApiError
from kelastic.localcluster.apiserver.patch import PatchError, json_patch, merge_patch, strategic_merge_patch
from kelastic.localcluster.apiserver.protobuf import MAGIC, ProtobufError, decode_object
from kelastic.localcluster.apiserver.schema import apply_defaults, prune, validate
from kelastic.localcluster.apiserver.selectors import (
    make_predicate,
    parse_field_selector,
    parse_label_selector,
)
from kelastic.localcluster.apiserver.ssa import applied_fields, removed_fields, without_fields
from kelastic.localcluster.apiserver.table import human_duration, jsonpath

POD = {
    "metadata": {"name": "p", "finalizers": ["a"]},
    "spec": {
        "containers": [
            {
                "name": "main",
                "image": "x",
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                "ports": [{"containerPort": 80}],
            },
            {"name": "side", "image": "y"},
        ],
        "volumes": [{"name": "v", "emptyDir": {}}],
    },
}


@pytest.mark.parametrize(
    ("patch", "check"),
    [
        (
            {"spec": {"containers": [{"name": "main", "image": "z"}]}},
            lambda o: [c["image"] for c in o["spec"]["containers"]] == ["z", "y"],
        ),
        (
            {"spec": {"containers": [{"name": "side", "$patch": "delete"}]}},
            lambda o: [c["name"] for c in o["spec"]["containers"]] == ["main"],
        ),
        (
            {"spec": {"containers": [{"name": "main", "env": [{"name": "C", "value": "3"}]}]}},
            lambda o: [e["name"] for e in o["spec"]["containers"][0]["env"]] == ["A", "B", "C"],
        ),
        (
            {"spec": {"containers": [{"name": "main", "env": [{"name": "A", "$patch": "delete"}]}]}},
            lambda o: [e["name"] for e in o["spec"]["containers"][0]["env"]] == ["B"],
        ),
        (
            {"spec": {"containers": [{"name": "main", "ports": [{"containerPort": 81}]}]}},
            lambda o: [p["containerPort"] for p in o["spec"]["containers"][0]["ports"]] == [80, 81],
        ),
        ({"metadata": {"finalizers": ["b"]}}, lambda o: o["metadata"]["finalizers"] == ["a", "b"]),
        (
            {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}},
            lambda o: o["metadata"]["finalizers"] == [],
        ),
        (
            {"spec": {"$setElementOrder/containers": [{"name": "side"}, {"name": "main"}]}},
            lambda o: [c["name"] for c in o["spec"]["containers"]] == ["side", "main"],
        ),
        (
            {
                "spec": {
                    "volumes": [
                        {"name": "v", "hostPath": {"path": "/tmp"}, "$retainKeys": ["name", "hostPath"]}
                    ]
                }
            },
            lambda o: o["spec"]["volumes"] == [{"name": "v", "hostPath": {"path": "/tmp"}}],
        ),
        (
            {"spec": {"containers": [{"name": "only", "image": "o"}, {"$patch": "replace"}]}},
            lambda o: [c["name"] for c in o["spec"]["containers"]] == ["only"],
        ),
        ({"spec": {"volumes": None}}, lambda o: "volumes" not in o["spec"]),
    ],
)
def test_strategic_merge_patch(patch: dict, check: object) -> None:
    out = strategic_merge_patch(POD, patch)
    assert check(out)  # type: ignore[operator]
    assert POD["spec"]["containers"][0]["image"] == "x"  # the input is untouched


def test_merge_and_json_patch() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None, "d": 3}, "l": [2]}) == {
        "a": {"c": 2, "d": 3},
        "l": [2],
    }
    doc = {"a": [1, 2], "b": {"c": 1}}
    ops = [
        {"op": "add", "path": "/a/-", "value": 3},
        {"op": "replace", "path": "/b/c", "value": 2},
        {"op": "copy", "from": "/b", "path": "/d"},
        {"op": "move", "from": "/a/0", "path": "/e"},
        {"op": "remove", "path": "/b"},
        {"op": "test", "path": "/d/c", "value": 2},
    ]
    assert json_patch(doc, ops) == {"a": [2, 3], "d": {"c": 2}, "e": 1}
    with pytest.raises(PatchError, match="test failed"):
        json_patch(doc, [{"op": "test", "path": "/b/c", "value": 9}])
    with pytest.raises(PatchError, match="missing key"):
        json_patch(doc, [{"op": "remove", "path": "/nope"}])


SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["image"],
            "properties": {
                "image": {"type": "string", "pattern": "^[a-z]+$"},
                "replicas": {"type": "integer", "minimum": 1, "maximum": 5, "default": 1},
                "mode": {"type": "string", "enum": ["a", "b"]},
                "port": {"x-kubernetes-int-or-string": True},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "nested": {
                    "type": "object",
                    "default": {},
                    "properties": {"x": {"type": "integer", "default": 7}},
                },
            },
        }
    },
}


def test_schema_prune_default_validate() -> None:
    obj = {
        "apiVersion": "x/v1",
        "kind": "K",
        "metadata": {"name": "n"},
        "spec": {"image": "abc", "junk": 1, "free": {"any": {"thing": 1}}},
    }
    pruned, dropped = prune(obj, SCHEMA)
    assert dropped == ["spec.junk"] and pruned["spec"]["free"] == {"any": {"thing": 1}}
    defaulted = apply_defaults(pruned, SCHEMA)
    assert defaulted["spec"]["replicas"] == 1 and defaulted["spec"]["nested"] == {"x": 7}
    assert validate(defaulted, SCHEMA) == []
    bad = {"spec": {"image": "ABC", "replicas": 9, "mode": "c", "port": True, "tags": ["a", "b", "c"]}}
    causes = {c.field: c for c in validate(bad, SCHEMA)}
    assert set(causes) == {"spec.image", "spec.replicas", "spec.mode", "spec.port", "spec.tags"}
    assert "should be less than or equal to 5" in causes["spec.replicas"].message
    assert causes["spec.mode"].reason == "FieldValueNotSupported"
    assert [c.field for c in validate({"spec": {}}, SCHEMA)] == ["spec.image"]


def test_selectors() -> None:
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "labels": {"app": "web", "tier": "fe"}},
        "status": {"phase": "Running"},
        "spec": {"nodeName": "n1"},
    }

    def match(labels: str = "", fields: str = "", ns: str | None = None) -> bool:
        return make_predicate(ns, parse_label_selector(labels), parse_field_selector(fields, "Pod"))(pod)

    assert match("app=web,tier in (fe,be)") and match("app!=db,!missing") and match("tier")
    assert not match("app notin (web)") and not match("missing")
    assert match(fields="status.phase=Running,spec.nodeName=n1,metadata.namespace=ns")
    assert not match(fields="metadata.name!=p") and not match(ns="other")
    with pytest.raises(ApiError):
        parse_label_selector("app in web")
    with pytest.raises(ApiError):
        parse_field_selector("spec.bogus=1", "Pod")


def test_jsonpath_and_durations() -> None:
    obj = {
        "status": {"conditions": [{"type": "A", "status": "False"}, {"type": "Ready", "status": "True"}]},
        "spec": {"items": [{"n": 1}, {"n": 2}], "m": {"k.x": "v"}},
    }
    assert jsonpath(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert jsonpath(obj, ".spec.items[*].n") == [1, 2]
    assert jsonpath(obj, ".spec.items[1].n") == [2]
    assert jsonpath(obj, ".spec.m['k.x']") == ["v"]
    assert jsonpath(obj, ".spec.nope") == []
    assert [human_duration(s) for s in (5, 119, 125, 600, 3 * 3600 + 60, 30 * 3600, 3 * 86400 + 3600)] == [
        "5s",
        "119s",
        "2m5s",
        "10m",
        "3h1m",
        "30h",
        "3d1h",
    ]


def test_server_side_apply_field_sets() -> None:
    first = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"a": "1", "b": "2"}},
        "spec": {"containers": [{"name": "c", "image": "x", "args": ["1"]}]},
    }
    second = {
        "metadata": {"name": "p", "labels": {"a": "1"}},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }
    f1, f2 = applied_fields(first, True), applied_fields(second, True)
    assert 'k:{"name":"c"}' in f1["f:spec"]["f:containers"]
    removed = removed_fields(f1, f2)
    live = {**first, "metadata": {**first["metadata"], "labels": {"a": "1", "b": "2", "other": "x"}}}
    out = without_fields(live, removed)
    assert out["metadata"]["labels"] == {"a": "1", "other": "x"}
    assert out["spec"]["containers"] == [{"name": "c", "image": "x"}]


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def test_protobuf_configmap() -> None:
    meta = _field(1, b"cm") + _field(11, _field(1, b"app") + _field(2, b"web"))
    raw = _field(1, meta) + _field(2, _field(1, b"key") + _field(2, b"value"))
    envelope = _field(1, _field(1, b"v1") + _field(2, b"ConfigMap")) + _field(2, raw)
    assert decode_object(MAGIC + envelope) == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cm", "labels": {"app": "web"}},
        "data": {"key": "value"},
    }
    other = _field(1, _field(1, b"v1") + _field(2, b"Pod")) + _field(2, b"")
    with pytest.raises(ProtobufError, match="kubectl apply -f"):
        decode_object(MAGIC + other)


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ("self.minReplicas <= self.maxReplicas", True),
        ("has(self.name) && self.name.startsWith('a')", True),
        ("!has(self.nope) || self.nope > 1", True),
        ("size(self.items) == 3 && self.items.all(x, x > 0)", True),
        ("self.items.exists_one(x, x > 1)", False),
        ("self.items.map(x, x * 2) == [2, 4, 6]", True),
        ("self.items.filter(x, x % 2 == 1).size() == 2", True),
        ("'a' in self.m && self.m.a + 1 == 2", True),
        ("self.minReplicas == 2 ? self.name.matches('^[a-c]+$') : false", True),
    ],
)
def test_cel_subset(rule: str, expected: bool) -> None:
    from kelastic.localcluster.apiserver.cel import evaluate

    value = {"minReplicas": 2, "maxReplicas": 4, "name": "abc", "items": [1, 2, 3], "m": {"a": 1}}
    assert evaluate(rule, value) is expected


def test_validation_rules_in_schemas() -> None:
    from kelastic.localcluster.apiserver.schema import validate_rules

    spec_schema = {
        "type": "object",
        "x-kubernetes-validations": [
            {"rule": "self.min <= self.max", "message": "min must not exceed max"},
            {"rule": "self.max >= oldSelf.max", "message": "max may not shrink"},
            {"rule": "self.unsupported(1)"},
        ],
        "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}},
    }
    root = {"type": "object", "properties": {"spec": spec_schema}}
    assert validate_rules({"spec": {"min": 1, "max": 2}}, root) == []
    causes = validate_rules({"spec": {"min": 3, "max": 2}}, root, {"spec": {"min": 1, "max": 4}})
    assert [(c.field, c.message) for c in causes] == [
        ("spec", "Invalid value: min must not exceed max"),
        ("spec", "Invalid value: max may not shrink"),
    ]
