"""Sanity of crds/elasticjob.yaml: a structural schema whose defaults, enums and paths agree with the operator."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from kelastic.operator.spec import (
    API_VERSION,
    CHECKPOINT_DEFAULTS,
    DEFAULTS,
    GROUP,
    KIND,
    PLURAL,
    AgentMode,
    CleanPodPolicy,
    RdzvBackend,
    RestartPolicy,
    parse_job,
)
from kelastic.operator.status import Phase

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "elasticjob.yaml"

# Keys a structural schema node may carry (apiextensions.k8s.io/v1 JSONSchemaProps we use or allow).
ALLOWED = {
    "type", "description", "properties", "required", "items", "additionalProperties", "enum", "default",
    "minimum", "maximum", "pattern", "format", "nullable", "minItems", "maxItems", "minLength", "maxLength",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "anyOf", "x-kubernetes-validations",
}  # fmt: skip
TYPES = {"object", "array", "string", "integer", "number", "boolean"}


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="module")
def version(crd: dict[str, Any]) -> dict[str, Any]:
    (v,) = crd["spec"]["versions"]
    return v


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in (node.get("properties") or {}).items():
        out += walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += walk(node["additionalProperties"], f"{path}.*")
    return out


def check_value(schema: dict[str, Any], value: Any, where: str) -> None:
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        assert isinstance(value, int | str), where
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), where
    elif kind == "string":
        assert isinstance(value, str), where
    elif kind == "boolean":
        assert isinstance(value, bool), where
    if "enum" in schema:
        assert value in schema["enum"], where
    if "minimum" in schema:
        assert value >= schema["minimum"], where


def test_identity(crd: dict[str, Any], version: dict[str, Any]) -> None:
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1" and crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"], names["categories"]) == (
        KIND,
        PLURAL,
        ["ej"],
        ["all"],
    )
    assert crd["spec"]["scope"] == "Namespaced"
    assert f"{crd['spec']['group']}/{version['name']}" == API_VERSION
    assert version["served"] and version["storage"]


def test_schema_is_structural(version: dict[str, Any]) -> None:
    root = version["schema"]["openAPIV3Schema"]
    assert root["type"] == "object"
    for path, node in walk(root):
        extra = set(node) - ALLOWED
        assert not extra, f"{path}: keys not allowed in a structural schema: {extra}"
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, f"{path}: int-or-string must not set type"
        else:
            assert node.get("type") in TYPES, f"{path}: every node needs a type"
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert node.get("type") == "object", f"{path}"
        for req in node.get("required") or []:
            assert req in (node.get("properties") or {}), f"{path}: required {req!r} is not a property"
        if "default" in node:
            check_value(node, node["default"], path)
        for value in node.get("enum") or []:
            check_value({k: v for k, v in node.items() if k != "enum"}, value, path)
    # metadata may only be a plain object at the root
    assert root["properties"]["metadata"] == {"type": "object"}


def test_enums_match_the_operator(version: dict[str, Any]) -> None:
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    worker = spec["replicaSpecs"]["properties"]["Worker"]["properties"]
    assert worker["restartPolicy"]["enum"] == [p.value for p in RestartPolicy]
    assert spec["cleanPodPolicy"]["enum"] == [p.value for p in CleanPodPolicy]
    assert spec["rdzvBackend"]["enum"] == [b.value for b in RdzvBackend]
    assert spec["agent"]["enum"] == [m.value for m in AgentMode]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == [p.value for p in Phase]
    assert spec["minReplicas"]["minimum"] == 1 and worker["replicas"]["minimum"] == 0


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Default like the API server does: fill in missing properties that declare a default."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for name, sub in (schema.get("properties") or {}).items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = apply_defaults(sub, out[name])
    return out


def test_schema_defaults_agree_with_the_operator(kit: SimpleNamespace, version: dict[str, Any]) -> None:
    body = kit.job_body(replicas=3)
    defaulted = apply_defaults(version["schema"]["openAPIV3Schema"], body)
    assert defaulted != body, "the schema declares defaults"
    assert parse_job(defaulted).spec == parse_job(body).spec


def declared_defaults(node: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(property path, default) of every property of the schema that declares a default."""
    out = []
    for name, sub in (node.get("properties") or {}).items():
        if "default" in sub:
            out.append(((*path, name), sub["default"]))
        out += declared_defaults(sub, (*path, name))
    return out


def without(body: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node = out
    for part in path[:-1]:
        if part not in node:
            return out  # an object the body leaves out holds nothing to remove
        node = node[part]
    node.pop(path[-1], None)
    return out


def with_value(body: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return out


def another_value(schema: dict[str, Any], default: Any) -> Any:
    """A valid value other than ``default``, to show the operator reads the field at all."""
    if isinstance(default, dict):  # an object defaulted whole: change its first defaulted property
        name, sub = next((n, sub) for n, sub in schema["properties"].items() if "default" in sub)
        return {**default, name: another_value(sub, sub["default"])}
    if schema.get("enum"):
        return next(v for v in schema["enum"] if v != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    raise AssertionError(f"no other value known for a default of {default!r}: extend another_value")


def test_every_schema_default_is_the_operators_default(kit: SimpleNamespace, version: dict[str, Any]) -> None:
    """One source of defaults: for each default the CRD declares, a job that leaves the field
    out parses exactly as one that spells the default out (as the API server fills it in), and a
    job that sets another value parses differently (the operator reads the field)."""
    root = version["schema"]["openAPIV3Schema"]
    found = declared_defaults(root)
    assert len(found) >= 8, found  # spec's defaults today; a schema read wrongly finds none
    base = kit.job_body(replicas=3)
    for path, default in found:
        assert path[0] == "spec", f"{'.'.join(path)}: a default outside spec is not checked here"
        left_out = without(base, path)
        spelled_out = with_value(left_out, path, copy.deepcopy(default))
        where = ".".join(path)
        plain = parse_job(left_out)
        assert plain.error is None, f"{where}: {plain.error}"
        assert parse_job(spelled_out).spec == plain.spec, (
            f"{where}: the CRD defaults it to {default!r}, but the operator's own default differs"
        )
        schema = root
        for part in path:
            schema = schema["properties"][part]
        other = parse_job(with_value(left_out, path, another_value(schema, default)))
        assert other.error is None and other.spec != plain.spec, f"{where}: the operator ignores the field"


def test_the_schema_declares_every_default_of_the_operator(version: dict[str, Any]) -> None:
    """The other direction: each default JobSpec has (other than "unset") is in the CRD too, with
    the same value, so ``kubectl get -o yaml`` shows what the operator will do."""

    def snake(name: str) -> str:
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()

    found = declared_defaults(version["schema"]["openAPIV3Schema"])
    in_job = [
        (path, default) for path, default in found if path[:2] != ("spec", "checkpoint") or len(path) == 2
    ]
    declared = {snake(path[-1]): default for path, default in in_job}
    mine = {name: getattr(value, "value", value) for name, value in DEFAULTS.items() if value is not None}
    assert declared == {**mine, "checkpoint": {}}  # every job has a checkpoint, with its own defaults
    in_checkpoint = {
        snake(path[-1]): d for path, d in found if path[:2] == ("spec", "checkpoint") and len(path) == 3
    }
    assert in_checkpoint == {name: value for name, value in CHECKPOINT_DEFAULTS.items() if value is not None}


def resolve(root: dict[str, Any], json_path: str) -> dict[str, Any]:
    node = root
    for part in json_path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_printer_columns_and_scale_paths_exist(version: dict[str, Any]) -> None:
    root = version["schema"]["openAPIV3Schema"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Phase", "Min", "Max", "Desired", "Ready", "Standby", "World", "Re-forms", "Progress", "Checkpoint",
        "Queue", "Goodput", "Age",
    ]  # fmt: skip
    for col in version["additionalPrinterColumns"]:
        if col["jsonPath"] == ".metadata.creationTimestamp":
            assert col["type"] == "date"
            continue
        node = resolve(root, col["jsonPath"])
        assert node["type"] == col["type"], col
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicaSpecs.Worker.replicas"
    for key in ("specReplicasPath", "statusReplicasPath", "labelSelectorPath"):
        assert resolve(root, scale[key])["type"] in ("integer", "string"), key
    assert version["subresources"]["status"] == {}


@pytest.mark.parametrize(
    ("endpoint", "valid"),
    [
        ("10.0.0.5:29400", True),
        ("etcd.svc:2379", True),
        ("[fd00::1]:29400", True),
        ("fd00::1:29400", False),  # ambiguous: the port cannot be told from the last group
        ("nohost", False),
    ],
)
def test_endpoint_pattern_agrees_with_the_operator(
    kit: SimpleNamespace, version: dict[str, Any], endpoint: str, valid: bool
) -> None:
    import re

    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert bool(re.match(spec["rdzvEndpoint"]["pattern"], endpoint)) is valid
    assert (parse_job(kit.job_body(rdzvEndpoint=endpoint)).error is None) is valid


def test_replicas_is_required(version: dict[str, Any]) -> None:
    """The scale subresource reads replicaSpecs.Worker.replicas: a missing one would read as 0."""
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    worker = spec["replicaSpecs"]["properties"]["Worker"]
    assert "replicas" in worker["required"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicaSpecs.Worker.replicas"
