"""The ``meta.k8s.io/v1`` Table format that ``kubectl get`` asks for.

:func:`to_table` renders objects with the columns kubectl shows for built-in
kinds (pods: READY, STATUS, RESTARTS, AGE, …) and, for custom resources, the
CRD's ``additionalPrinterColumns`` evaluated with a JSONPath subset
(``.a.b``, ``['key']``, ``[n]``, ``[*]``, ``[?(@.f=="v")]``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .resources import ResourceType

__all__ = ["human_duration", "jsonpath", "to_table"]

Obj = dict[str, Any]
Column = tuple[str, str, int, Callable[[Obj], Any]]  # name, type, priority, cell


def human_duration(seconds: float) -> str:
    """Age the way kubectl prints it (``45s``, ``3m20s``, ``5h``, ``2d3h``)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = m // 60
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if h < 24 * 8:
        return f"{h // 24}d{h % 24}h" if h % 24 else f"{h // 24}d"
    if h < 24 * 365 * 2:
        return f"{h // 24}d"
    if h < 24 * 365 * 8:
        d = h // 24
        return f"{d // 365}y{d % 365}d" if d % 365 else f"{d // 365}y"
    return f"{h // 24 // 365}y"


def _since(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    try:
        t = datetime.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    except ValueError:
        return "<unknown>"
    return human_duration((datetime.now(timezone.utc) - t).total_seconds())


def _age(obj: Obj) -> str:
    return _since(obj["metadata"].get("creationTimestamp"))


def _name(obj: Obj) -> str:
    return obj["metadata"]["name"]


_TOKENS = re.compile(
    r"""\.([A-Za-z0-9_\-$/]+)|\['([^']*)'\]|\["([^"]*)"\]|\[(\*|-?\d+)\]|\[\?\(@((?:\.[A-Za-z0-9_\-]+)+)\s*(==|!=)\s*(?:"([^"]*)"|'([^']*)'|([^)\s]+))\)\]"""
)


def jsonpath(obj: Any, expr: str) -> list[Any]:
    """Values ``expr`` selects in ``obj`` (the subset printer columns use)."""
    expr = expr.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    if expr.startswith("$"):
        expr = expr[1:]
    current = [obj]
    pos = 0
    while pos < len(expr):
        m = _TOKENS.match(expr, pos)
        if not m:
            return []
        pos = m.end()
        key = m.group(1) or m.group(2) or m.group(3)
        nxt: list[Any] = []
        for cur in current:
            if key is not None:
                if isinstance(cur, dict) and key in cur:
                    nxt.append(cur[key])
            elif m.group(4) is not None:
                if isinstance(cur, list):
                    if m.group(4) == "*":
                        nxt.extend(cur)
                    else:
                        i = int(m.group(4))
                        if -len(cur) <= i < len(cur):
                            nxt.append(cur[i])
                elif isinstance(cur, dict) and m.group(4) == "*":
                    nxt.extend(cur.values())
            else:
                path = m.group(5).strip(".").split(".")
                want = next(g for g in (m.group(7), m.group(8), m.group(9)) if g is not None)
                for item in cur if isinstance(cur, list) else []:
                    v: Any = item
                    for p in path:
                        v = v.get(p) if isinstance(v, dict) else None
                    sv = v if isinstance(v, str) else json.dumps(v)
                    if (sv == want) == (m.group(6) == "=="):
                        nxt.append(item)
        current = nxt
    return current


def _crd_cell(obj: Obj, col: Obj) -> Any:
    found = jsonpath(obj, col.get("jsonPath", ""))
    if not found or found[0] is None:
        return None
    v = found[0]
    t = col.get("type", "string")
    if t == "date":
        return _since(v) if isinstance(v, str) else None
    if t == "integer":
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    if t == "number":
        return v
    if t == "boolean":
        return v
    if isinstance(v, str):
        return v
    return json.dumps(v, separators=(",", ":"))


@dataclass
class _PodRow:
    """The READY, STATUS and RESTARTS cells of a pod, as kube-apiserver's ``printPod`` makes them."""

    ready: str
    status: str
    restarts: str


def _restartable(init: Obj | None) -> bool:
    """A sidecar: an init container with ``restartPolicy: Always``."""
    return bool(init) and (init or {}).get("restartPolicy") == "Always"


def _terminated_reason(term: Obj, prefix: str = "") -> str:
    if term.get("reason"):
        return prefix + term["reason"]
    if term.get("signal"):
        return f"{prefix}Signal:{term['signal']}"
    return f"{prefix}ExitCode:{term.get('exitCode', 0)}"


def _finished_at(status: Obj) -> str:
    return ((status.get("lastState") or {}).get("terminated") or {}).get("finishedAt") or ""


def _has_condition(status: Obj, kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in status.get("conditions") or [])


def _pod_row(pod: Obj) -> _PodRow:
    """Port of ``printPod`` (pkg/printers/internalversion): what ``kubectl get pods`` reads.

    A container status holds one state (``waiting``, ``running`` or ``terminated``); the
    STATUS column is the last container's reason, ``Running`` while one runs and is ready,
    ``Terminating`` for a pod being deleted that has not reached a terminal phase.
    """
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or ""
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("reason") == "SchedulingGated":
            reason = "SchedulingGated"
    inits = {c.get("name"): c for c in spec.get("initContainers") or []}
    total = len(spec.get("containers") or []) + sum(1 for c in inits.values() if _restartable(c))
    ready = restarts = sidecar_restarts = 0
    last_restart = sidecar_last_restart = ""
    initializing = False
    init_statuses = status.get("initContainerStatuses") or []
    for i, s in enumerate(init_statuses):
        state = s.get("state") or {}
        restarts += int(s.get("restartCount", 0))
        last_restart = max(last_restart, _finished_at(s))
        sidecar = _restartable(inits.get(s.get("name")))
        if sidecar:
            sidecar_restarts += int(s.get("restartCount", 0))
            sidecar_last_restart = max(sidecar_last_restart, _finished_at(s))
        term = state.get("terminated")
        waiting = (state.get("waiting") or {}).get("reason")
        if term and term.get("exitCode") == 0:
            continue
        if sidecar and s.get("started"):
            ready += 1 if s.get("ready") else 0
            continue
        initializing = True
        if term:
            reason = _terminated_reason(term, "Init:")
        elif waiting and waiting != "PodInitializing":
            reason = "Init:" + waiting
        else:
            reason = f"Init:{i}/{len(inits)}"
        break
    if not initializing or _has_condition(status, "Initialized"):
        restarts, last_restart = sidecar_restarts, sidecar_last_restart
        has_running, error_reason = False, ""
        for s in reversed(status.get("containerStatuses") or []):
            state = s.get("state") or {}
            restarts += int(s.get("restartCount", 0))
            last_restart = max(last_restart, _finished_at(s))
            if (state.get("waiting") or {}).get("reason"):
                reason = state["waiting"]["reason"]
            elif state.get("terminated") is not None:
                reason = _terminated_reason(state["terminated"])
                if state["terminated"].get("exitCode", 0) != 0:
                    error_reason = reason
            elif s.get("ready") and state.get("running") is not None:
                has_running = True
                ready += 1
        if reason == "Completed":
            if has_running and _has_condition(status, "Ready"):
                reason = "Running"
            elif error_reason:
                reason = error_reason
            elif has_running:
                reason = "NotReady"
    deleting = bool(pod["metadata"].get("deletionTimestamp"))
    if deleting and status.get("reason") == "NodeLost":
        reason = "Unknown"
    elif deleting and status.get("phase") not in ("Succeeded", "Failed"):
        reason = "Terminating"
    shown = str(restarts)
    if restarts and last_restart:
        shown = f"{restarts} ({_since(last_restart)} ago)"
    return _PodRow(f"{ready}/{total}", reason, shown)


def _svc_ports(svc: Obj) -> str:
    parts = []
    for p in (svc.get("spec") or {}).get("ports") or []:
        if p.get("nodePort"):
            parts.append(f"{p.get('port')}:{p['nodePort']}/{p.get('protocol', 'TCP')}")
        else:
            parts.append(f"{p.get('port')}/{p.get('protocol', 'TCP')}")
    return ",".join(parts) or "<none>"


def _endpoints(ep: Obj) -> str:
    out = []
    for subset in ep.get("subsets") or []:
        ports = [p.get("port") for p in subset.get("ports") or []] or [None]
        for a in subset.get("addresses") or []:
            for port in ports:
                out.append(f"{a.get('ip')}:{port}" if port is not None else str(a.get("ip")))
    if not out:
        return "<none>"
    return ",".join(out[:3]) + (f" + {len(out) - 3} more..." if len(out) > 3 else "")


def _node_status(node: Obj) -> str:
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return "Ready" if c.get("status") == "True" else "NotReady"
    return "Unknown"


def _event_object(ev: Obj) -> str:
    io = ev.get("involvedObject") or ev.get("regarding") or {}
    return f"{str(io.get('kind', '')).lower()}/{io.get('name', '')}"


def _builtin_columns(kind: str) -> list[Column]:
    age: Column = ("Age", "string", 0, _age)
    if kind == "Pod":
        return [
            ("Ready", "string", 0, lambda o: _pod_row(o).ready),
            ("Status", "string", 0, lambda o: _pod_row(o).status),
            ("Restarts", "string", 0, lambda o: _pod_row(o).restarts),
            age,
            ("IP", "string", 1, lambda o: (o.get("status") or {}).get("podIP") or "<none>"),
            ("Node", "string", 1, lambda o: (o.get("spec") or {}).get("nodeName") or "<none>"),
            ("Nominated Node", "string", 1, lambda o: "<none>"),
            ("Readiness Gates", "string", 1, lambda o: "<none>"),
        ]
    if kind == "Service":
        return [
            ("Type", "string", 0, lambda o: (o.get("spec") or {}).get("type", "")),
            ("Cluster-IP", "string", 0, lambda o: (o.get("spec") or {}).get("clusterIP") or "<none>"),
            ("External-IP", "string", 0, lambda o: "<none>"),
            ("Port(s)", "string", 0, _svc_ports),
            age,
            (
                "Selector",
                "string",
                1,
                lambda o: (
                    ",".join(
                        f"{k}={v}" for k, v in sorted(((o.get("spec") or {}).get("selector") or {}).items())
                    )
                    or "<none>"
                ),
            ),
        ]
    if kind == "Namespace":
        return [("Status", "string", 0, lambda o: (o.get("status") or {}).get("phase", "")), age]
    if kind == "Node":
        return [
            ("Status", "string", 0, _node_status),
            ("Roles", "string", 0, lambda o: "<none>"),
            age,
            (
                "Version",
                "string",
                0,
                lambda o: ((o.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", ""),
            ),
        ]
    if kind == "Endpoints":
        return [("Endpoints", "string", 0, _endpoints), age]
    if kind == "ConfigMap":
        return [
            ("Data", "integer", 0, lambda o: len(o.get("data") or {}) + len(o.get("binaryData") or {})),
            age,
        ]
    if kind == "Secret":
        return [
            ("Type", "string", 0, lambda o: o.get("type", "")),
            ("Data", "integer", 0, lambda o: len(o.get("data") or {})),
            age,
        ]
    if kind == "Event":
        return [
            (
                "Last Seen",
                "string",
                0,
                lambda o: _since(
                    o.get("lastTimestamp") or o.get("eventTime") or o["metadata"].get("creationTimestamp")
                ),
            ),
            ("Type", "string", 0, lambda o: o.get("type", "")),
            ("Reason", "string", 0, lambda o: o.get("reason", "")),
            ("Object", "string", 0, _event_object),
            ("Message", "string", 0, lambda o: o.get("message") or o.get("note") or ""),
        ]
    if kind == "Deployment":
        return [
            (
                "Ready",
                "string",
                0,
                lambda o: (
                    f"{(o.get('status') or {}).get('readyReplicas', 0)}/"
                    f"{(o.get('spec') or {}).get('replicas', 0)}"
                ),
            ),
            ("Up-to-date", "integer", 0, lambda o: (o.get("status") or {}).get("updatedReplicas", 0)),
            ("Available", "integer", 0, lambda o: (o.get("status") or {}).get("availableReplicas", 0)),
            age,
        ]
    if kind == "CustomResourceDefinition":
        return [("Created At", "date", 0, lambda o: o["metadata"].get("creationTimestamp", ""))]
    if kind == "Lease":
        return [("Holder", "string", 0, lambda o: (o.get("spec") or {}).get("holderIdentity") or ""), age]
    if kind == "ServiceAccount":
        return [("Secrets", "integer", 0, lambda o: len(o.get("secrets") or [])), age]
    return [age]


def _columns(rt: ResourceType) -> list[Column]:
    if rt.crd and rt.printer_columns:
        return [
            (
                c["name"],
                c.get("type", "string"),
                int(c.get("priority", 0)),
                (lambda col: lambda o: _crd_cell(o, col))(c),
            )
            for c in rt.printer_columns
        ]
    if rt.crd:
        return [("Age", "date", 0, _age)]
    return _builtin_columns(rt.kind)


def to_table(
    rt: ResourceType,
    objs: list[Obj],
    include_object: str = "PartialObjectMetadata",
    list_meta: Obj | None = None,
) -> Obj:
    """A Table of ``objs`` with ``rt``'s columns (NAME first)."""
    cols = [("Name", "string", 0, _name), *_columns(rt)]
    rows = []
    for o in objs:
        row: Obj = {"cells": [c[3](o) for c in cols]}
        if include_object == "Object":
            row["object"] = o
        elif include_object != "None":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": o["metadata"],
            }
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta or {},
        "columnDefinitions": [
            {
                "name": n,
                "type": "string" if t == "date" else t,
                "format": "name" if n == "Name" else "",
                "description": n,
                "priority": p,
            }
            for n, t, p, _ in cols
        ],
        "rows": rows,
    }
