"""Decoding of the Kubernetes protobuf request bodies that kubectl's typed clients send.

``kubectl create namespace|configmap|secret|serviceaccount|service|role|…`` and
``kubectl auth can-i`` encode their request bodies as protobuf
(``application/vnd.kubernetes.protobuf``): the 4-byte magic ``k8s\\0`` followed
by a ``runtime.Unknown`` envelope holding the type and the object's bytes. The
server answers in JSON, which those clients accept, so only decoding is needed,
and only for the kinds those commands create. :data:`MESSAGES` declares their
field numbers (from the Kubernetes API's generated.proto files); any other kind
is refused with an error that says to send the manifest with ``kubectl apply -f``.
"""

from __future__ import annotations

import base64
from datetime import datetime, timezone
from typing import Any

__all__ = ["MAGIC", "ProtobufError", "decode_object"]

MAGIC = b"k8s\x00"

Obj = dict[str, Any]
# field number -> (json name, type, repeated); type is a scalar kind or a message name.
Fields = dict[int, tuple[str, str, bool]]


class ProtobufError(ValueError):
    """The body is not a protobuf object this server can read."""


def _f(name: str, kind: str = "string", repeated: bool = False) -> tuple[str, str, bool]:
    return (name, kind, repeated)


_META: Fields = {
    1: _f("name"),
    2: _f("generateName"),
    3: _f("namespace"),
    5: _f("uid"),
    6: _f("resourceVersion"),
    7: _f("generation", "int"),
    8: _f("creationTimestamp", "Time"),
    9: _f("deletionTimestamp", "Time"),
    10: _f("deletionGracePeriodSeconds", "int"),
    11: _f("labels", "map"),
    12: _f("annotations", "map"),
    13: _f("ownerReferences", "OwnerReference", True),
    14: _f("finalizers", "string", True),
}

MESSAGES: dict[str, Fields] = {
    "Unknown": {
        1: _f("typeMeta", "TypeMeta"),
        2: _f("raw", "raw"),
        3: _f("contentEncoding"),
        4: _f("contentType"),
    },
    "TypeMeta": {1: _f("apiVersion"), 2: _f("kind")},
    "ObjectMeta": _META,
    "Time": {1: _f("seconds", "int"), 2: _f("nanos", "int")},
    "OwnerReference": {
        1: _f("kind"),
        3: _f("name"),
        4: _f("uid"),
        5: _f("apiVersion"),
        6: _f("controller", "bool"),
        7: _f("blockOwnerDeletion", "bool"),
    },
    "ObjectReference": {
        1: _f("kind"),
        2: _f("namespace"),
        3: _f("name"),
        4: _f("uid"),
        5: _f("apiVersion"),
        6: _f("resourceVersion"),
        7: _f("fieldPath"),
    },
    "LocalObjectReference": {1: _f("name")},
    "IntOrString": {1: _f("type", "int"), 2: _f("intVal", "int"), 3: _f("strVal")},
    # core/v1
    "Namespace": {1: _f("metadata", "ObjectMeta"), 2: _f("spec", "NamespaceSpec")},
    "NamespaceSpec": {1: _f("finalizers", "string", True)},
    "ConfigMap": {
        1: _f("metadata", "ObjectMeta"),
        2: _f("data", "map"),
        3: _f("binaryData", "map_bytes"),
        4: _f("immutable", "bool"),
    },
    "Secret": {
        1: _f("metadata", "ObjectMeta"),
        2: _f("data", "map_bytes"),
        3: _f("type"),
        4: _f("stringData", "map"),
        5: _f("immutable", "bool"),
    },
    "ServiceAccount": {
        1: _f("metadata", "ObjectMeta"),
        2: _f("secrets", "ObjectReference", True),
        3: _f("imagePullSecrets", "LocalObjectReference", True),
        4: _f("automountServiceAccountToken", "bool"),
    },
    "Service": {1: _f("metadata", "ObjectMeta"), 2: _f("spec", "ServiceSpec")},
    "ServiceSpec": {
        1: _f("ports", "ServicePort", True),
        2: _f("selector", "map"),
        3: _f("clusterIP"),
        18: _f("clusterIPs", "string", True),
        4: _f("type"),
        5: _f("externalIPs", "string", True),
        7: _f("sessionAffinity"),
        10: _f("externalName"),
    },
    "ServicePort": {
        1: _f("name"),
        2: _f("protocol"),
        6: _f("appProtocol"),
        3: _f("port", "int"),
        4: _f("targetPort", "IntOrString"),
        5: _f("nodePort", "int"),
    },
    "PodTemplateSpec": {1: _f("metadata", "ObjectMeta"), 2: _f("spec", "PodSpec")},
    "PodSpec": {
        2: _f("containers", "Container", True),
        3: _f("restartPolicy"),
        4: _f("terminationGracePeriodSeconds", "int"),
        7: _f("nodeSelector", "map"),
        8: _f("serviceAccountName"),
        10: _f("nodeName"),
        19: _f("schedulerName"),
        20: _f("initContainers", "Container", True),
    },
    "Container": {
        1: _f("name"),
        2: _f("image"),
        3: _f("command", "string", True),
        4: _f("args", "string", True),
        5: _f("workingDir"),
        6: _f("ports", "ContainerPort", True),
        7: _f("env", "EnvVar", True),
        8: _f("resources", "ResourceRequirements"),
        14: _f("imagePullPolicy"),
    },
    "ContainerPort": {
        1: _f("name"),
        2: _f("hostPort", "int"),
        3: _f("containerPort", "int"),
        4: _f("protocol"),
    },
    "EnvVar": {1: _f("name"), 2: _f("value")},
    "ResourceRequirements": {1: _f("limits", "map_quantity"), 2: _f("requests", "map_quantity")},
    "LabelSelector": {
        1: _f("matchLabels", "map"),
        2: _f("matchExpressions", "LabelSelectorRequirement", True),
    },
    "LabelSelectorRequirement": {1: _f("key"), 2: _f("operator"), 3: _f("values", "string", True)},
    # apps/v1, batch/v1
    "Deployment": {1: _f("metadata", "ObjectMeta"), 2: _f("spec", "DeploymentSpec")},
    "DeploymentSpec": {
        1: _f("replicas", "int"),
        2: _f("selector", "LabelSelector"),
        3: _f("template", "PodTemplateSpec"),
        4: _f("strategy", "DeploymentStrategy"),
    },
    "DeploymentStrategy": {1: _f("type")},
    "Job": {1: _f("metadata", "ObjectMeta"), 2: _f("spec", "JobSpec")},
    "JobSpec": {
        1: _f("parallelism", "int"),
        2: _f("completions", "int"),
        3: _f("activeDeadlineSeconds", "int"),
        4: _f("selector", "LabelSelector"),
        6: _f("template", "PodTemplateSpec"),
        7: _f("backoffLimit", "int"),
    },
    "CronJob": {1: _f("metadata", "ObjectMeta"), 2: _f("spec", "CronJobSpec")},
    "CronJobSpec": {
        1: _f("schedule"),
        3: _f("concurrencyPolicy"),
        4: _f("suspend", "bool"),
        5: _f("jobTemplate", "JobTemplateSpec"),
    },
    "JobTemplateSpec": {1: _f("metadata", "ObjectMeta"), 2: _f("spec", "JobSpec")},
    # rbac.authorization.k8s.io/v1
    "Role": {1: _f("metadata", "ObjectMeta"), 2: _f("rules", "PolicyRule", True)},
    "ClusterRole": {1: _f("metadata", "ObjectMeta"), 2: _f("rules", "PolicyRule", True)},
    "PolicyRule": {
        1: _f("verbs", "string", True),
        2: _f("apiGroups", "string", True),
        3: _f("resources", "string", True),
        4: _f("resourceNames", "string", True),
        5: _f("nonResourceURLs", "string", True),
    },
    "RoleBinding": {
        1: _f("metadata", "ObjectMeta"),
        2: _f("subjects", "Subject", True),
        3: _f("roleRef", "RoleRef"),
    },
    "ClusterRoleBinding": {
        1: _f("metadata", "ObjectMeta"),
        2: _f("subjects", "Subject", True),
        3: _f("roleRef", "RoleRef"),
    },
    "Subject": {1: _f("kind"), 2: _f("apiGroup"), 3: _f("name"), 4: _f("namespace")},
    "RoleRef": {1: _f("apiGroup"), 2: _f("kind"), 3: _f("name")},
    # authorization.k8s.io/v1
    "SelfSubjectAccessReview": {
        1: _f("metadata", "ObjectMeta"),
        2: _f("spec", "SelfSubjectAccessReviewSpec"),
    },
    "SelfSubjectAccessReviewSpec": {
        1: _f("resourceAttributes", "ResourceAttributes"),
        2: _f("nonResourceAttributes", "NonResourceAttributes"),
    },
    "ResourceAttributes": {
        1: _f("namespace"),
        2: _f("verb"),
        3: _f("group"),
        4: _f("version"),
        5: _f("resource"),
        6: _f("subresource"),
        7: _f("name"),
    },
    "NonResourceAttributes": {1: _f("path"), 2: _f("verb")},
    # meta/v1: what Go clients (Helm's uninstall among them) send with a DELETE
    "DeleteOptions": {
        1: _f("gracePeriodSeconds", "optional int"),
        2: _f("preconditions", "Preconditions"),
        3: _f("orphanDependents", "optional bool"),
        4: _f("propagationPolicy"),
        5: _f("dryRun", "string", True),
    },
    "Preconditions": {1: _f("uid"), 2: _f("resourceVersion")},
}

#: Kinds whose top-level protobuf can be decoded (typed-client creates).
TOP_LEVEL = (
    "Namespace",
    "ConfigMap",
    "Secret",
    "ServiceAccount",
    "Service",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "SelfSubjectAccessReview",
    "Deployment",
    "Job",
    "CronJob",
    "DeleteOptions",
)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            out.append((num, value))
        elif wire == 2:
            size, pos = _varint(data, pos)
            out.append((num, data[pos : pos + size]))
            pos += size
        elif wire == 1:
            out.append((num, int.from_bytes(data[pos : pos + 8], "little")))
            pos += 8
        elif wire == 5:
            out.append((num, int.from_bytes(data[pos : pos + 4], "little")))
            pos += 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _scalar(kind: str, value: int | bytes) -> Any:
    if kind == "string":
        return value.decode() if isinstance(value, bytes) else str(value)
    if kind in ("int", "optional int"):
        return _signed(value) if isinstance(value, int) else 0
    if kind in ("bool", "optional bool"):
        return bool(value)
    if kind == "raw":
        return value
    raise ProtobufError(f"unknown scalar kind {kind}")


def _map_entry(value: bytes, kind: str) -> tuple[str, str]:
    key, val = "", b""
    for num, v in _fields(value):
        if num == 1 and isinstance(v, bytes):
            key = v.decode()
        elif num == 2 and isinstance(v, bytes):
            val = v
    if kind == "map_bytes":
        return key, base64.b64encode(val).decode()
    if kind == "map_quantity":  # a Quantity message: its field 1 is the string form
        return key, next((v.decode() for n, v in _fields(val) if n == 1 and isinstance(v, bytes)), "")
    return key, val.decode()


def _message(name: str, data: bytes) -> Any:
    schema = MESSAGES[name]
    out: Obj = {}
    for num, value in _fields(data):
        if num not in schema:
            continue  # fields this server does not read are ignored, as unknown JSON fields would be
        json_name, kind, repeated = schema[num]
        if kind.startswith("map"):
            if not isinstance(value, bytes):
                raise ProtobufError(f"{name}.{json_name}: map entry is not length-delimited")
            k, v = _map_entry(value, kind)
            out.setdefault(json_name, {})[k] = v
            continue
        if kind in MESSAGES:
            if not isinstance(value, bytes):
                raise ProtobufError(f"{name}.{json_name}: expected a message")
            item = _message(kind, value)
        else:
            item = _scalar(kind, value)
        if repeated:
            out.setdefault(json_name, []).append(item)
        elif item not in ("", 0, False, {}) or kind == "IntOrString" or kind.startswith("optional"):
            # Go writes zero values of plain fields; their JSON form omits them. An optional
            # (pointer) field is written only when set: gracePeriodSeconds=0 means "now".
            out[json_name] = item
    if name == "Time":
        if not out.get("seconds"):
            return ""  # the zero time: JSON omits it
        t = datetime.fromtimestamp(out["seconds"], tz=timezone.utc)
        return t.strftime("%Y-%m-%dT%H:%M:%SZ")
    if name == "IntOrString":
        return out.get("strVal", "") if out.get("type") == 1 else out.get("intVal", 0)
    return out


def decode_object(body: bytes) -> Obj:
    """The JSON form of a protobuf-encoded object; raises :class:`ProtobufError` naming the problem."""
    if not body.startswith(MAGIC):
        raise ProtobufError("the body lacks the Kubernetes protobuf magic prefix")
    envelope = _message("Unknown", body[len(MAGIC) :])
    type_meta = envelope.get("typeMeta") or {}
    kind = type_meta.get("kind", "")
    if kind not in TOP_LEVEL:
        raise ProtobufError(
            f"protobuf bodies of kind {kind or '(unknown)'} are not supported by kelastic local; write the "
            "object as YAML and use `kubectl apply -f FILE` (or `kubectl create -f FILE`)"
        )
    obj = _message(kind, envelope.get("raw", b""))
    return {"apiVersion": type_meta.get("apiVersion", ""), "kind": kind, **obj}
