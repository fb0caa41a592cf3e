"""Which pods back a Service: the endpoints rule of Kubernetes, as a pure function.

For a Service with a selector, :func:`compute_subsets` lists the pods the selector
matches that have an IP and are not terminating or finished: ready pods under
``addresses``, the others under ``notReadyAddresses`` (or under ``addresses`` when the
service sets ``publishNotReadyAddresses``), with each service port resolved to the
pod's port (a named ``targetPort`` looked up in the pod's container ports). Pods whose
ports resolve alike share one subset: the shape of an Endpoints object's ``subsets``.

kelastic local publishes no Endpoints nor EndpointSlices for its pods: the API server
refuses loopback addresses in both (and every pod here has one, ``127.1.x.y``), on a
real control plane as on the emulator. The service proxy applies this rule itself
(:mod:`kelastic.localcluster.controllers.proxy`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["compute_subsets", "pod_is_ready", "selector_matches"]


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str] | None) -> bool:
    """A Service selector (equality on every key) against a pod's labels."""
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _target_port(port: Mapping[str, Any], pod: Mapping[str, Any]) -> int | None:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for cport in container.get("ports") or []:
            if cport.get("name") == target and cport.get("protocol", "TCP") == port.get("protocol", "TCP"):
                return int(cport["containerPort"])
    return None


def compute_subsets(service: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``subsets`` of the service's Endpoints, deterministic (sorted) for comparison."""
    spec = service.get("spec") or {}
    selector = spec.get("selector") or {}
    namespace = (service.get("metadata") or {}).get("namespace", "default")
    publish_not_ready = bool(spec.get("publishNotReadyAddresses"))
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        if meta.get("namespace", "default") != namespace or not selector_matches(
            selector, meta.get("labels")
        ):
            continue
        ip = status.get("podIP")
        if not ip or status.get("phase") in ("Succeeded", "Failed"):
            continue
        if meta.get("deletionTimestamp") and not publish_not_ready:
            continue
        ports: list[dict[str, Any]] = []
        for port in spec.get("ports") or []:
            number = _target_port(port, pod)
            if number is None:
                continue
            entry: dict[str, Any] = {"port": number, "protocol": port.get("protocol", "TCP")}
            if port.get("name"):
                entry["name"] = port["name"]
            ports.append(entry)
        if spec.get("ports") and not ports:
            continue
        address: dict[str, Any] = {
            "ip": ip,
            "targetRef": {
                "kind": "Pod",
                "namespace": namespace,
                "name": meta.get("name"),
                "uid": meta.get("uid"),
            },
        }
        if (pod.get("spec") or {}).get("nodeName"):
            address["nodeName"] = pod["spec"]["nodeName"]
        key = tuple(sorted((p.get("name", ""), p["port"], p["protocol"]) for p in ports))
        subset = groups.setdefault(key, {"addresses": [], "notReadyAddresses": [], "ports": ports})
        ready = pod_is_ready(pod) or publish_not_ready
        subset["addresses" if ready else "notReadyAddresses"].append(address)
    subsets = []
    for key in sorted(groups):
        subset = groups[key]
        out: dict[str, Any] = {}
        for field in ("addresses", "notReadyAddresses"):
            if subset[field]:
                out[field] = sorted(subset[field], key=lambda a: (a["ip"], a["targetRef"]["name"]))
        if out:
            out["ports"] = sorted(subset["ports"], key=lambda p: (p.get("name", ""), p["port"]))
            subsets.append(out)
    return subsets
