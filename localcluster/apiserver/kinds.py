"""Per-kind rules of the built-in resources: defaults, server-set fields, validation.

Pure functions over plain dicts: the registry calls them on every create and
update. They mirror what the real API server's strategies do for the fields
clients look at (pods start Pending with defaulted fields, services get a
ClusterIP in ``127.2.0.0/16``, secrets fold ``stringData`` into ``data``,
namespaces are Active with the ``kubernetes`` finalizer, CRDs are Established).
"""

from __future__ import annotations

import base64
import ipaddress
import re
from typing import Any

from ..common.ipam import IpAllocator, IpExhaustedError
from .errors import ApiError, FieldCause
from .patch import clone
from .resources import ResourceType

__all__ = [
    "SERVICE_NETWORK",
    "ServiceAddresses",
    "bound_pod",
    "crd_status",
    "event_to_core",
    "event_to_events_v1",
    "metadata_causes",
    "name_causes",
    "pod_grace_period",
    "prepare_create",
    "prepare_update",
    "update_causes",
    "validate_builtin",
]

Obj = dict[str, Any]

#: ClusterIPs of the local cluster's Services.
SERVICE_NETWORK = ipaddress.IPv4Network("127.2.0.0/16")

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN_KINDS_EXEMPT = {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}


def name_causes(rt: ResourceType, name: str) -> list[FieldCause]:
    """Name validation as the API does it (DNS label for namespaces/services, else subdomain)."""
    if rt.kind in _SUBDOMAIN_KINDS_EXEMPT:
        bad = "/" in name or "%" in name or name in (".", "..")
        msg = "may not contain '/' or '%'"
    elif rt.kind == "Service":
        bad = not _LABEL_1035.match(name) or len(name) > 63
        msg = (
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
            "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
            "regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
        )
    elif rt.kind == "Namespace":
        bad = not _LABEL_1123.match(name) or len(name) > 63
        msg = (
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
            "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
            "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
        )
    else:
        bad = not _SUBDOMAIN.match(name) or len(name) > 253
        msg = (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
            "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )
    if bad:
        return [FieldCause("FieldValueInvalid", f'Invalid value: "{name}": {msg}', "metadata.name")]
    return []


class ServiceAddresses:
    """ClusterIP and NodePort bookkeeping for Services."""

    def __init__(self, network: ipaddress.IPv4Network = SERVICE_NETWORK) -> None:
        self.ips = IpAllocator(network)
        self.node_ports: set[int] = set()

    def restore(self, svc: Obj) -> None:
        spec = svc.get("spec") or {}
        ip = spec.get("clusterIP")
        if ip and ip != "None":
            self.ips.reserve(ip, svc["metadata"]["uid"])
        for p in spec.get("ports") or ():
            if p.get("nodePort"):
                self.node_ports.add(int(p["nodePort"]))

    def release(self, svc: Obj) -> None:
        spec = svc.get("spec") or {}
        ip = spec.get("clusterIP")
        if ip and ip != "None":
            self.ips.release(ip)
        for p in spec.get("ports") or ():
            self.node_ports.discard(p.get("nodePort"))

    def next_node_port(self) -> int:
        for port in range(30000, 32768):
            if port not in self.node_ports:
                self.node_ports.add(port)
                return port
        raise IpExhaustedError("all NodePorts 30000-32767 are in use")


def _qos(spec: Obj) -> str:
    requests = limits = False
    guaranteed = True
    for c in spec.get("containers") or ():
        res = c.get("resources") or {}
        r, lim = res.get("requests") or {}, res.get("limits") or {}
        requests |= bool(r)
        limits |= bool(lim)
        if not lim or any(r.get(k, lim[k]) != lim[k] for k in lim) or set(lim) < {"cpu", "memory"}:
            guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def _default_container(c: Obj) -> None:
    image = c.get("image") or ""
    tagless = ":" not in image.rsplit("/", 1)[-1] and "@" not in image
    c.setdefault("imagePullPolicy", "Always" if tagless or image.endswith(":latest") else "IfNotPresent")
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    c.setdefault("resources", {})
    for p in c.get("ports") or ():
        p.setdefault("protocol", "TCP")
    for e in c.get("env") or ():
        fr = (e.get("valueFrom") or {}).get("fieldRef")
        if fr is not None:
            fr.setdefault("apiVersion", "v1")


def _default_pod_spec(spec: Obj) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
    spec.setdefault("serviceAccount", spec["serviceAccountName"])
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    spec.setdefault("priority", 0)
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        _default_container(c)


def _default_endpoints(kind: str, obj: Obj) -> None:
    """Endpoints' and EndpointSlices' defaults: ports speak TCP, an endpoint's conditions exist."""
    if kind == "Endpoints":
        for subset in obj.get("subsets") or ():
            for port in subset.get("ports") or ():
                port.setdefault("protocol", "TCP")
    elif kind == "EndpointSlice":
        for port in obj.get("ports") or ():
            port.setdefault("protocol", "TCP")
        for endpoint in obj.get("endpoints") or ():
            endpoint.setdefault("conditions", {})


def prepare_create(rt: ResourceType, obj: Obj, services: ServiceAddresses) -> None:
    """Fill server-side defaults of a new built-in object (in place)."""
    kind = rt.kind if not rt.crd else ""
    _default_endpoints(kind, obj)
    if kind == "Pod":
        spec = obj.setdefault("spec", {})
        _default_pod_spec(spec)
        obj["status"] = {"phase": "Pending", "qosClass": _qos(spec)}
    elif kind == "Namespace":
        obj["spec"] = {"finalizers": ["kubernetes"]}
        obj["status"] = {"phase": "Active"}
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
    elif kind == "Service":
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        for p in spec.get("ports") or ():
            p.setdefault("protocol", "TCP")
            p.setdefault("targetPort", p.get("port"))
        if spec["type"] != "ExternalName":
            if not spec.get("clusterIP"):
                spec["clusterIP"] = services.ips.allocate(obj["metadata"]["uid"])
            elif spec["clusterIP"] != "None" and not services.ips.reserve(
                spec["clusterIP"], obj["metadata"]["uid"]
            ):
                raise ValueError(
                    f"spec.clusterIP: Invalid value: {spec['clusterIP']!r}: provided IP is not in the "
                    f"valid range ({services.ips.network}) or is already allocated"
                )
            spec["clusterIPs"] = [spec["clusterIP"]]
            spec.setdefault("ipFamilies", ["IPv4"])
            spec.setdefault("ipFamilyPolicy", "SingleStack")
            spec.setdefault("internalTrafficPolicy", "Cluster")
        if spec["type"] in ("NodePort", "LoadBalancer"):
            spec.setdefault("externalTrafficPolicy", "Cluster")
            for p in spec.get("ports") or ():
                if not p.get("nodePort"):
                    p["nodePort"] = services.next_node_port()
        obj["status"] = {"loadBalancer": {}}
    elif kind == "Secret":
        _fold_string_data(obj)
        obj.setdefault("type", "Opaque")
    elif kind == "CustomResourceDefinition":
        _default_crd(obj)
        obj["status"] = crd_status(obj)
    elif kind in ("Deployment", "ReplicaSet", "StatefulSet"):
        spec = obj.setdefault("spec", {})
        spec.setdefault("replicas", 1)
        template = spec.get("template") or {}
        if isinstance(template.get("spec"), dict):
            _default_pod_spec(template["spec"])
        obj.setdefault("status", {})
    elif kind == "Job":
        spec = obj.setdefault("spec", {})
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completions", 1)
        spec.setdefault("parallelism", 1)
        template = spec.get("template") or {}
        if isinstance(template.get("spec"), dict):
            _default_pod_spec(template["spec"])


def prepare_update(rt: ResourceType, new: Obj, old: Obj) -> None:
    """Carry server-owned fields of a built-in object over an update (in place)."""
    kind = rt.kind if not rt.crd else ""
    _default_endpoints(kind, new)
    if kind == "Service":
        spec = new.setdefault("spec", {})
        old_spec = old.get("spec") or {}
        for f in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if not spec.get(f) and old_spec.get(f):
                spec[f] = old_spec[f]
        for p in spec.get("ports") or ():
            p.setdefault("protocol", "TCP")
            p.setdefault("targetPort", p.get("port"))
    elif kind == "Secret":
        _fold_string_data(new)
    elif kind == "Pod":
        _default_pod_spec(new.setdefault("spec", {}))
    elif kind == "Namespace":
        new["spec"] = new.get("spec") or old.get("spec") or {}
    elif kind == "CustomResourceDefinition":
        _default_crd(new)


def _fold_string_data(obj: Obj) -> None:
    string_data = obj.pop("stringData", None)
    if string_data:
        data = obj.setdefault("data", {}) or {}
        for k, v in string_data.items():
            data[k] = base64.b64encode(str(v).encode()).decode()
        obj["data"] = data


def _default_crd(crd: Obj) -> None:
    spec = crd.setdefault("spec", {})
    names = spec.setdefault("names", {})
    if names.get("kind"):
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
    spec.setdefault("conversion", {"strategy": "None"})
    for v in spec.get("versions") or ():
        v.setdefault("served", True)
        v.setdefault("storage", False)


def crd_status(crd: Obj) -> Obj:
    """The status an accepted CRD carries (Established, names accepted)."""
    spec = crd["spec"]
    storage = [v["name"] for v in spec.get("versions") or () if v.get("storage")]
    old = crd.get("status") or {}
    stored = list(old.get("storedVersions") or [])
    for v in storage:
        if v not in stored:
            stored.append(v)
    return {
        "acceptedNames": dict(spec.get("names") or {}),
        "conditions": [
            {
                "type": "NamesAccepted",
                "status": "True",
                "reason": "NoConflicts",
                "message": "no conflicts found",
                "lastTransitionTime": crd["metadata"]["creationTimestamp"],
            },
            {
                "type": "Established",
                "status": "True",
                "reason": "InitialNamesAccepted",
                "message": "the initial names have been accepted",
                "lastTransitionTime": crd["metadata"]["creationTimestamp"],
            },
        ],
        "storedVersions": stored,
    }


def _crd_causes(crd: Obj) -> list[FieldCause]:
    out: list[FieldCause] = []
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group") or ""
    if not group or "." not in group:
        out.append(
            FieldCause(
                "FieldValueInvalid",
                f'Invalid value: "{group}": should be a domain with at least one dot',
                "spec.group",
            )
        )
    for f in ("plural", "kind"):
        if not names.get(f):
            out.append(FieldCause("FieldValueRequired", "Required value", f"spec.names.{f}"))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        out.append(
            FieldCause(
                "FieldValueNotSupported",
                f'Unsupported value: "{spec.get("scope", "")}": supported values: "Cluster", "Namespaced"',
                "spec.scope",
            )
        )
    versions = spec.get("versions") or []
    if not versions:
        out.append(
            FieldCause(
                "FieldValueRequired",
                "Required value: must have exactly one version marked as storage version",
                "spec.versions",
            )
        )
    elif sum(1 for v in versions if v.get("storage")) != 1:
        out.append(
            FieldCause(
                "FieldValueInvalid",
                "Invalid value: must have exactly one version marked as storage version",
                "spec.versions",
            )
        )
    for i, v in enumerate(versions):
        if not (v.get("schema") or {}).get("openAPIV3Schema"):
            out.append(
                FieldCause(
                    "FieldValueRequired",
                    "Required value: schemas are required",
                    f"spec.versions[{i}].schema.openAPIV3Schema",
                )
            )
    name = crd["metadata"].get("name", "")
    if names.get("plural") and group and name != f"{names['plural']}.{group}":
        out.append(
            FieldCause(
                "FieldValueInvalid",
                f'Invalid value: "{name}": must be spec.names.plural+"."+spec.group',
                "metadata.name",
            )
        )
    return out


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def _key_ok(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))


def metadata_causes(obj: Obj) -> list[FieldCause]:
    """Validation of labels, annotation keys and ownerReferences, for every kind."""
    meta = obj.get("metadata") or {}
    out: list[FieldCause] = []
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        return [
            FieldCause(
                "FieldValueTypeInvalid", "Invalid value: labels must be a map of strings", "metadata.labels"
            )
        ]
    for k, v in labels.items():
        if not _key_ok(str(k)):
            out.append(
                FieldCause(
                    "FieldValueInvalid",
                    f'Invalid value: "{k}": name part must consist of '
                    "alphanumeric characters, '-', '_' or '.', and must start and end with an "
                    "alphanumeric character, with an optional DNS subdomain prefix and '/'",
                    "metadata.labels",
                )
            )
        if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.match(v):
            out.append(
                FieldCause(
                    "FieldValueInvalid",
                    f'Invalid value: "{v}": a valid label must be an empty '
                    "string or consist of alphanumeric characters, '-', '_' or '.', and must start "
                    "and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or "
                    "'12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?"
                    "[A-Za-z0-9])?')",
                    "metadata.labels",
                )
            )
    for k, v in (meta.get("annotations") or {}).items():
        if not _key_ok(str(k)):
            out.append(
                FieldCause(
                    "FieldValueInvalid",
                    f'Invalid value: "{k}": name part must consist of '
                    "alphanumeric characters, '-', '_' or '.'",
                    "metadata.annotations",
                )
            )
        if not isinstance(v, str):
            out.append(
                FieldCause(
                    "FieldValueTypeInvalid",
                    f"Invalid value: annotation {k} must be a string",
                    "metadata.annotations",
                )
            )
    for i, ref in enumerate(meta.get("ownerReferences") or ()):
        for f in ("apiVersion", "kind", "name", "uid"):
            if not (isinstance(ref, dict) and ref.get(f)):
                out.append(
                    FieldCause(
                        "FieldValueInvalid",
                        f'Invalid value: "": {f} must not be empty',
                        f"metadata.ownerReferences[{i}].{f}",
                    )
                )
    return out


def endpoint_ip_problems(ip: str) -> list[str]:
    """Why ``ip`` may not be an address of an Endpoints or an EndpointSlice, in the real API
    server's words (empty when it may): no unspecified, loopback or link-local address.

    This is why kelastic local's pods, on 127.1.x addresses, appear in neither: the service
    proxy finds a Service's pods itself (kelastic.localcluster.controllers.endpoints).
    """
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return ["must be a valid IP address"]
    out = []
    if parsed.is_unspecified:
        out.append(f"may not be unspecified ({ip})")
    if parsed.is_loopback:
        out.append("may not be in the loopback range (127.0.0.0/8, ::1/128)")
    if parsed in ipaddress.ip_network("169.254.0.0/16") or parsed in ipaddress.ip_network("fe80::/10"):
        out.append("may not be in the link-local range (169.254.0.0/16, fe80::/10)")
    packed = parsed.packed
    if parsed in ipaddress.ip_network("224.0.0.0/24") or (
        parsed.version == 6 and packed[0] == 0xFF and packed[1] & 0x0F == 0x02
    ):
        out.append("may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)")
    return out


def _endpoints_causes(obj: Obj) -> list[FieldCause]:
    """An Endpoints address must be a valid IP outside the special ranges."""
    out: list[FieldCause] = []
    for i, subset in enumerate(obj.get("subsets") or ()):
        for group in ("addresses", "notReadyAddresses"):
            for j, address in enumerate(subset.get(group) or ()):
                ip, field = str(address.get("ip", "")), f"subsets[{i}].{group}[{j}].ip"
                for why in endpoint_ip_problems(ip):
                    out.append(FieldCause("FieldValueInvalid", f'Invalid value: "{ip}": {why}', field))
    return out


def _endpoint_slice_causes(obj: Obj) -> list[FieldCause]:
    """An EndpointSlice of type IPv4/IPv6 holds addresses of that family outside the special ranges."""
    family = obj.get("addressType")
    if family not in ("IPv4", "IPv6"):
        return []
    out: list[FieldCause] = []
    for i, endpoint in enumerate(obj.get("endpoints") or ()):
        addresses = endpoint.get("addresses") or []
        if not addresses:
            out.append(
                FieldCause("FieldValueRequired", "Required value", f"endpoints[{i}].addresses")
            )  # fmt: skip
        for j, ip in enumerate(addresses):
            field, problems = f"endpoints[{i}].addresses[{j}]", endpoint_ip_problems(str(ip))
            if not problems and ipaddress.ip_address(str(ip)).version != (4 if family == "IPv4" else 6):
                problems = [f"must be an {family} address"]
                field = f"endpoints[{i}].addresses"
            for why in problems:
                out.append(FieldCause("FieldValueInvalid", f'Invalid value: "{ip}": {why}', field))
    return out


def validate_builtin(rt: ResourceType, obj: Obj) -> list[FieldCause]:
    """The validation clients rely on for built-in kinds (required fields, basic shapes)."""
    if rt.crd:
        return []
    out: list[FieldCause] = []
    if rt.kind == "Pod":
        spec = obj.get("spec") or {}
        containers = spec.get("containers")
        if not containers:
            out.append(FieldCause("FieldValueRequired", "Required value", "spec.containers"))
        seen: set[str] = set()
        for i, c in enumerate(containers or ()):
            if not c.get("name"):
                out.append(FieldCause("FieldValueRequired", "Required value", f"spec.containers[{i}].name"))
            elif c["name"] in seen:
                out.append(
                    FieldCause(
                        "FieldValueDuplicate", f'Duplicate value: "{c["name"]}"', f"spec.containers[{i}].name"
                    )
                )
            seen.add(c.get("name", ""))
            if not c.get("image"):
                out.append(FieldCause("FieldValueRequired", "Required value", f"spec.containers[{i}].image"))
        rp = spec.get("restartPolicy")
        if rp not in ("Always", "OnFailure", "Never"):
            out.append(
                FieldCause(
                    "FieldValueNotSupported",
                    f'Unsupported value: "{rp}": supported values: "Always", "OnFailure", "Never"',
                    "spec.restartPolicy",
                )
            )
    elif rt.kind == "Service":
        spec = obj.get("spec") or {}
        for i, p in enumerate(spec.get("ports") or ()):
            if not isinstance(p.get("port"), int) or not 0 < p["port"] < 65536:
                out.append(
                    FieldCause(
                        "FieldValueInvalid",
                        f"Invalid value: {p.get('port')}: must be between 1 and 65535, inclusive",
                        f"spec.ports[{i}].port",
                    )
                )
        if spec.get("type") not in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"):
            out.append(
                FieldCause(
                    "FieldValueNotSupported",
                    f'Unsupported value: "{spec.get("type")}": '
                    'supported values: "ClusterIP", "ExternalName", "LoadBalancer", "NodePort"',
                    "spec.type",
                )
            )
    elif rt.kind == "CustomResourceDefinition":
        out.extend(_crd_causes(obj))
    elif rt.kind == "Endpoints":
        out.extend(_endpoints_causes(obj))
    elif rt.kind == "EndpointSlice":
        out.extend(_endpoint_slice_causes(obj))
    elif rt.kind == "ConfigMap":
        for k, v in (obj.get("data") or {}).items():
            if not isinstance(v, str):
                out.append(
                    FieldCause("FieldValueTypeInvalid", "Invalid value: must be a string", f"data.{k}")
                )
    return out


def pod_grace_period(pod: Obj, requested: int | None) -> int:
    """Seconds of graceful termination for deleting ``pod`` (0: remove at once).

    As in the API: an unscheduled or finished pod goes at once; otherwise the
    request's grace period, else the pod's terminationGracePeriodSeconds.
    """
    if not (pod.get("spec") or {}).get("nodeName"):
        return 0
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return 0
    if requested is not None:
        return max(0, int(requested))
    return int((pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30))


#: Field names of an events.k8s.io/v1 Event and of the same field in a core/v1 Event.
_EVENT_FIELDS = (
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
    ("reportingController", "reportingComponent"),
)
_EVENT_SHARED = ("eventTime", "series", "reportingInstance", "action", "reason", "type", "related")


def bound_pod(rt: ResourceType, old: Obj, node: str, now: str) -> Obj:
    """The pod ``old`` bound to ``node`` (the ``binding`` subresource): spec.nodeName and
    PodScheduled at once; 409 Conflict for a pod that is bound already or being deleted."""
    name = old["metadata"]["name"]
    current = (old.get("spec") or {}).get("nodeName")
    if current:
        raise ApiError.conflict(
            rt.group, rt.plural, name, f"pod {name} is already assigned to node {current!r}"
        )
    if old["metadata"].get("deletionTimestamp"):
        raise ApiError.conflict(rt.group, rt.plural, name, f"pod {name} is being deleted, cannot be assigned")
    new = clone(old)
    new["spec"]["nodeName"] = node
    status = new.setdefault("status", {})
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
    conditions.append(
        {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
    )
    status["conditions"] = conditions
    return new


def event_to_events_v1(core: Obj) -> Obj:
    """A core/v1 Event as events.k8s.io/v1 shows it (both APIs share one storage)."""
    out: Obj = {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": core.get("metadata", {})}
    for new, old in _EVENT_FIELDS:
        if core.get(old) not in (None, "", {}):
            out[new] = core[old]
    for f in _EVENT_SHARED:
        if core.get(f) not in (None, ""):
            out[f] = core[f]
    if not out.get("eventTime"):
        # Legacy events have no eventTime; clients of events.k8s.io/v1 require one.
        ts = (
            core.get("firstTimestamp")
            or core.get("lastTimestamp")
            or out["metadata"].get("creationTimestamp")
        )
        if ts:
            out["eventTime"] = ts.replace("Z", ".000000Z") if ts.endswith("Z") and "." not in ts else ts
    return out


def event_to_core(ev: Obj) -> Obj:
    """An events.k8s.io/v1 Event as the core/v1 Event it is stored as."""
    out: Obj = {"apiVersion": "v1", "kind": "Event", "metadata": ev.get("metadata") or {}}
    for new, old in _EVENT_FIELDS:
        if ev.get(new) not in (None, "", {}):
            out[old] = ev[new]
    for f in _EVENT_SHARED:
        if ev.get(f) not in (None, ""):
            out[f] = ev[f]
    return out


_POD_MUTABLE = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds")


def _pod_spec_shape(spec: Obj) -> Obj:
    """A pod spec without the fields an update may change (images, deadline, tolerations)."""
    out = {k: v for k, v in spec.items() if k not in _POD_MUTABLE}
    for key in ("containers", "initContainers"):
        if isinstance(out.get(key), list):
            out[key] = [{k: v for k, v in c.items() if k != "image"} for c in out[key] if isinstance(c, dict)]
    return out


def update_causes(rt: ResourceType, new: Obj, old: Obj, status: bool = False) -> list[FieldCause]:
    """Fields an update may not change (pod specs, immutable ConfigMaps/Secrets, ClusterIPs);
    with ``status``, what a write of the status subresource may not change (a pod's QoS class,
    which the API server sets from the spec at creation)."""
    if rt.crd:
        return []
    out: list[FieldCause] = []
    if status:
        before = (old.get("status") or {}).get("qosClass")
        after = (new.get("status") or {}).get("qosClass")
        if rt.kind == "Pod" and before and after != before:
            out.append(FieldCause("FieldValueInvalid", f'Invalid value: "{after}": field is immutable',
                                  "status.qosClass"))  # fmt: skip
        return out
    if rt.kind == "Pod" and _pod_spec_shape(new.get("spec") or {}) != _pod_spec_shape(old.get("spec") or {}):
        out.append(
            FieldCause(
                "FieldValueForbidden",
                "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to "
                "existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
                "previously negative)",
                "spec",
            )
        )
    elif rt.kind in ("ConfigMap", "Secret") and old.get("immutable"):
        for f in ("data", "binaryData", "immutable"):
            if new.get(f) != old.get(f):
                out.append(
                    FieldCause(
                        "FieldValueForbidden", "Forbidden: field is immutable when `immutable` is set", f
                    )
                )
    elif rt.kind == "Service":
        before = (old.get("spec") or {}).get("clusterIP")
        after = (new.get("spec") or {}).get("clusterIP")
        if before and after != before:
            out.append(
                FieldCause(
                    "FieldValueInvalid", f'Invalid value: "{after}": field is immutable', "spec.clusterIP"
                )
            )
    return out
