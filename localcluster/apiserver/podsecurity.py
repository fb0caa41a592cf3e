"""Pod Security admission: the ``baseline`` and ``restricted`` Pod Security Standards.

The API server emulator enforces the standard a namespace names in its label
``pod-security.kubernetes.io/enforce`` (``privileged``, ``baseline`` or
``restricted``; ``pod-security.kubernetes.io/enforce-version`` only changes the
version shown in messages, the checks are always those of the latest standard).
A pod that violates it is refused at creation with 403 Forbidden and the message
Kubernetes writes::

    pods "x" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false
    (container "c" must set securityContext.allowPrivilegeEscalation=false), ...

The standard of ``pod-security.kubernetes.io/warn`` (which defaults to the enforced
one when that is stricter and the label is unset) gives a pod it admits, and any
workload whose pod template violates it (Deployments, Jobs, ...: never refused), the
warning ``would violate PodSecurity "restricted:latest": ...`` (:func:`policy_of`).

:func:`violations` is the pure check, one entry per failed check in the order
Kubernetes reports them. Checked: host namespaces, privileged containers,
capabilities, hostPath volumes and (restricted) volume types, host ports, /proc
mount type, sysctls, seccomp, SELinux options, Windows host processes,
privilege escalation, runAsNonRoot and runAsUser. AppArmor annotations are not
checked (kelastic local has no AppArmor).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    "ENFORCE_LABEL",
    "ENFORCE_VERSION_LABEL",
    "WARN_LABEL",
    "Level",
    "forbidden_message",
    "level_of",
    "pod_template_spec",
    "policy_of",
    "violations",
    "warning_message",
]

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
ENFORCE_VERSION_LABEL = "pod-security.kubernetes.io/enforce-version"
WARN_LABEL = "pod-security.kubernetes.io/warn"
WARN_VERSION_LABEL = "pod-security.kubernetes.io/warn-version"

Obj = Mapping[str, Any]


class Level(str, enum.Enum):
    PRIVILEGED = "privileged"
    BASELINE = "baseline"
    RESTRICTED = "restricted"


#: Capabilities a container may add under ``baseline`` (the container runtimes' default set).
_BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
        "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip
_SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)  # fmt: skip
_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
_RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)


def level_of(labels: Mapping[str, str]) -> tuple[Level, str]:
    """The enforced level and version a namespace's labels name (privileged when unset or unknown)."""
    try:
        level = Level(labels.get(ENFORCE_LABEL, "privileged"))
    except ValueError:
        level = Level.PRIVILEGED  # Kubernetes refuses such labels on the namespace itself
    return level, labels.get(ENFORCE_VERSION_LABEL) or "latest"


_STRICTNESS = {Level.PRIVILEGED: 0, Level.BASELINE: 1, Level.RESTRICTED: 2}


def policy_of(labels: Mapping[str, str]) -> tuple[tuple[Level, str], tuple[Level, str]]:
    """(enforced, warned) ``(level, version)`` of a namespace's labels. An unset warn level is
    the enforced one when that is stricter than privileged, as Kubernetes defaults it."""
    enforce = level_of(labels)
    if WARN_LABEL in labels:
        try:
            warn_level = Level(labels[WARN_LABEL])
        except ValueError:
            warn_level = Level.PRIVILEGED  # Kubernetes fails open for warn
        return enforce, (warn_level, labels.get(WARN_VERSION_LABEL) or "latest")
    if ENFORCE_LABEL in labels and _STRICTNESS[enforce[0]] > 0:
        return enforce, (enforce[0], labels.get(WARN_VERSION_LABEL) or enforce[1])
    return enforce, (Level.PRIVILEGED, "latest")


def _quote(names: Iterable[Any]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def _containers_phrase(names: list[str]) -> str:
    return f"container {_quote(names)}" if len(names) == 1 else f"containers {_quote(names)}"


def _containers(spec: Obj) -> list[Obj]:
    return [
        *(spec.get("initContainers") or []),
        *(spec.get("containers") or []),
        *(spec.get("ephemeralContainers") or []),
    ]


def _sc(obj: Obj) -> Obj:
    return obj.get("securityContext") or {}


def _per_container(spec: Obj, bad: Callable[[Obj], bool]) -> list[str]:
    return [str(c.get("name", "")) for c in _containers(spec) if bad(c)]


# -- baseline ------------------------------------------------------------------------------
def _host_namespaces(spec: Obj) -> str | None:
    on = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    return f"host namespaces ({', '.join(on)})" if on else None


def _privileged(spec: Obj) -> str | None:
    names = _per_container(spec, lambda c: _sc(c).get("privileged") is True)
    if not names:
        return None
    return f"privileged ({_containers_phrase(names)} must not set securityContext.privileged=true)"


def _added(c: Obj) -> list[str]:
    return [str(a) for a in (_sc(c).get("capabilities") or {}).get("add") or []]


def _capabilities_baseline(spec: Obj) -> str | None:
    names: list[str] = []
    caps: list[str] = []
    for c in _containers(spec):
        extra = [a for a in _added(c) if a not in _BASELINE_CAPABILITIES]
        if extra:
            names.append(str(c.get("name", "")))
            caps += [a for a in extra if a not in caps]
    if not names:
        return None
    return (
        f"non-default capabilities ({_containers_phrase(names)} must not include {_quote(caps)} "
        "in securityContext.capabilities.add)"
    )


def _host_path(spec: Obj) -> str | None:
    names = [str(v.get("name", "")) for v in spec.get("volumes") or [] if "hostPath" in v]
    if not names:
        return None
    return f"hostPath volumes ({'volume' if len(names) == 1 else 'volumes'} {_quote(names)})"


def _host_ports(spec: Obj) -> str | None:
    names: list[str] = []
    ports: list[str] = []
    for c in _containers(spec):
        used = [str(p["hostPort"]) for p in c.get("ports") or [] if p.get("hostPort")]
        if used:
            names.append(str(c.get("name", "")))
            ports += used
    if not names:
        return None
    noun = "hostPort" if len(ports) == 1 else "hostPorts"
    verb = "uses" if len(names) == 1 else "use"
    return f"hostPort ({_containers_phrase(names)} {verb} {noun} {', '.join(ports)})"


def _probe_hosts(spec: Obj) -> str | None:
    """Probes and lifecycle handlers may not name another host (baseline, since 1.34)."""
    names: set[str] = set()
    hosts: set[str] = set()
    for c in _containers(spec):
        handlers = [c.get(p) for p in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += [(c.get("lifecycle") or {}).get(h) for h in ("postStart", "preStop")]
        for handler in handlers:
            for kind in ("httpGet", "tcpSocket"):
                host = ((handler or {}).get(kind) or {}).get("host")
                if host:
                    names.add(str(c.get("name", "")))
                    hosts.add(str(host))
    if not names:
        return None
    verb = "uses" if len(names) == 1 else "use"
    noun = "probe or lifecycle host" if len(hosts) == 1 else "probe or lifecycle hosts"
    return (
        f"probe or lifecycle host ({_containers_phrase(sorted(names))} {verb} {noun} {_quote(sorted(hosts))})"
    )


def _host_process(spec: Obj) -> str | None:
    pod = (_sc(spec).get("windowsOptions") or {}).get("hostProcess") is True
    names = _per_container(spec, lambda c: (_sc(c).get("windowsOptions") or {}).get("hostProcess") is True)
    if not pod and not names:
        return None
    return "hostProcess (pod or containers must not set securityContext.windowsOptions.hostProcess=true)"


def _proc_mount(spec: Obj) -> str | None:
    names = _per_container(spec, lambda c: _sc(c).get("procMount") not in (None, "Default"))
    if not names:
        return None
    return f'procMount ({_containers_phrase(names)} must not set securityContext.procMount to "Unmasked")'


def _se_linux(spec: Obj) -> str | None:
    def bad(sc: Obj) -> bool:
        opts = sc.get("seLinuxOptions") or {}
        return opts.get("type", "") not in _SELINUX_TYPES or bool(opts.get("user") or opts.get("role"))

    if not bad(_sc(spec)) and not _per_container(spec, lambda c: bad(_sc(c))):
        return None
    return "seLinuxOptions (pod and containers must not set forbidden securityContext.seLinuxOptions)"


def _sysctls(spec: Obj) -> str | None:
    bad = [str(s.get("name")) for s in _sc(spec).get("sysctls") or [] if s.get("name") not in _SAFE_SYSCTLS]
    return f"forbidden sysctls ({', '.join(bad)})" if bad else None


def _seccomp_type(sc: Obj) -> str | None:
    profile = sc.get("seccompProfile") or {}
    return profile.get("type")


def _seccomp_baseline(spec: Obj) -> str | None:
    pod = _seccomp_type(_sc(spec)) == "Unconfined"
    names = _per_container(spec, lambda c: _seccomp_type(_sc(c)) == "Unconfined")
    if not pod and not names:
        return None
    who = " and ".join(w for w in ("pod" if pod else "", _containers_phrase(names) if names else "") if w)
    return f'seccompProfile ({who} must not set securityContext.seccompProfile.type to "Unconfined")'


# -- restricted ----------------------------------------------------------------------------
def _privilege_escalation(spec: Obj) -> str | None:
    names = _per_container(spec, lambda c: _sc(c).get("allowPrivilegeEscalation") is not False)
    if not names:
        return None
    return (
        f"allowPrivilegeEscalation != false ({_containers_phrase(names)} must set "
        "securityContext.allowPrivilegeEscalation=false)"
    )


def _capabilities_restricted(spec: Obj) -> str | None:
    not_dropped = _per_container(
        spec, lambda c: "ALL" not in ((_sc(c).get("capabilities") or {}).get("drop") or [])
    )
    names: list[str] = []
    caps: list[str] = []
    for c in _containers(spec):
        extra = [a for a in _added(c) if a != "NET_BIND_SERVICE"]
        if extra:
            names.append(str(c.get("name", "")))
            caps += [a for a in extra if a not in caps]
    parts = []
    if not_dropped:
        parts.append(f'{_containers_phrase(not_dropped)} must set securityContext.capabilities.drop=["ALL"]')
    if names:
        parts.append(
            f"{_containers_phrase(names)} must not include {_quote(caps)} in securityContext.capabilities.add"
        )
    return f"unrestricted capabilities ({'; '.join(parts)})" if parts else None


def _volume_types(spec: Obj) -> str | None:
    names: list[str] = []
    kinds: list[str] = []
    for v in spec.get("volumes") or []:
        kind = next((k for k in v if k != "name"), "")
        if kind and kind not in _RESTRICTED_VOLUMES:
            names.append(str(v.get("name", "")))
            kinds += [kind] if kind not in kinds else []
    if not names:
        return None
    if len(names) == 1:
        return f"restricted volume types (volume {_quote(names)} uses restricted volume type {_quote(kinds)})"
    noun = "type" if len(kinds) == 1 else "types"
    return f"restricted volume types (volumes {_quote(names)} use restricted volume {noun} {_quote(kinds)})"


def _run_as_non_root(spec: Obj) -> str | None:
    pod = _sc(spec).get("runAsNonRoot")
    parts = []
    if pod is False:
        parts.append("pod must not set securityContext.runAsNonRoot=false")
    explicit_false = _per_container(spec, lambda c: _sc(c).get("runAsNonRoot") is False)
    if explicit_false:
        parts.append(f"{_containers_phrase(explicit_false)} must not set securityContext.runAsNonRoot=false")
    if pod is not True:
        unset = _per_container(spec, lambda c: _sc(c).get("runAsNonRoot") is None)
        if unset:
            parts.append(f"pod or {_containers_phrase(unset)} must set securityContext.runAsNonRoot=true")
    return f"runAsNonRoot != true ({'; '.join(parts)})" if parts else None


def _run_as_user(spec: Obj) -> str | None:
    pod = _sc(spec).get("runAsUser") == 0
    names = _per_container(spec, lambda c: _sc(c).get("runAsUser") == 0)
    if not pod and not names:
        return None
    who = " and ".join(w for w in ("pod" if pod else "", _containers_phrase(names) if names else "") if w)
    return f"runAsUser=0 ({who} must not set runAsUser=0)"


def _seccomp_restricted(spec: Obj) -> str | None:
    allowed = ("RuntimeDefault", "Localhost")
    pod = _seccomp_type(_sc(spec))
    parts = []
    if pod is not None and pod not in allowed:
        parts.append(f'pod must not set securityContext.seccompProfile.type to "{pod}"')
    wrong = _per_container(spec, lambda c: _seccomp_type(_sc(c)) not in (None, *allowed))
    if wrong:
        parts.append(
            f"{_containers_phrase(wrong)} must not set securityContext.seccompProfile.type to an unrestricted value"
        )
    if pod is None:
        unset = _per_container(spec, lambda c: _seccomp_type(_sc(c)) is None)
        if unset:
            parts.append(
                f"pod or {_containers_phrase(unset)} must set securityContext.seccompProfile.type to "
                '"RuntimeDefault" or "Localhost"'
            )
    return f"seccompProfile ({'; '.join(parts)})" if parts else None


# Kubernetes reports the failed baseline checks first, then the restricted ones, each
# group sorted by check ID (byte order); a restricted check replaces the baseline check it
# tightens (capabilities, hostPath volumes, seccomp).
_BASELINE_CHECKS: list[tuple[str, Callable[[Obj], str | None]]] = [
    ("capabilities_baseline", _capabilities_baseline),
    ("hostNamespaces", _host_namespaces),
    ("hostPathVolumes", _host_path),
    ("hostPorts", _host_ports),
    ("hostProbesAndHostLifecycle", _probe_hosts),
    ("privileged", _privileged),
    ("procMount", _proc_mount),
    ("seLinuxOptions", _se_linux),
    ("seccompProfile_baseline", _seccomp_baseline),
    ("sysctls", _sysctls),
    ("windowsHostProcess", _host_process),
]
_RESTRICTED_CHECKS: list[tuple[str, Callable[[Obj], str | None]]] = [
    ("allowPrivilegeEscalation", _privilege_escalation),
    ("capabilities_restricted", _capabilities_restricted),
    ("restrictedVolumes", _volume_types),
    ("runAsNonRoot", _run_as_non_root),
    ("runAsUser", _run_as_user),
    ("seccompProfile_restricted", _seccomp_restricted),
]
_REPLACED = {
    "capabilities_baseline": "capabilities_restricted",
    "hostPathVolumes": "restrictedVolumes",
    "seccompProfile_baseline": "seccompProfile_restricted",
}


def violations(pod_spec: Obj, level: Level) -> list[str]:
    """What in ``pod_spec`` the ``level`` standard forbids, in Kubernetes' order and words."""
    if level is Level.PRIVILEGED:
        return []
    checks = sorted(_BASELINE_CHECKS, key=lambda c: c[0])  # byte order, as Go sorts the IDs
    if level is Level.RESTRICTED:
        checks = [c for c in checks if c[0] not in _REPLACED] + sorted(_RESTRICTED_CHECKS, key=lambda c: c[0])
    out = []
    for _id, check in checks:
        found = check(pod_spec)
        if found:
            out.append(found)
    return out


#: Where each kind Pod Security admission judges keeps its pod spec.
_TEMPLATE_PATHS = {
    "Pod": ("spec",),
    "PodTemplate": ("template", "spec"),
    "ReplicationController": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}


def pod_template_spec(kind: str, obj: Obj) -> Obj | None:
    """The pod spec Pod Security admission judges in an object of ``kind`` (None: not judged)."""
    path = _TEMPLATE_PATHS.get(kind)
    if path is None:
        return None
    node: Any = obj
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


def warning_message(level: Level, version: str, found: list[str]) -> str:
    """The warning of the API server for a pod or pod template that violates the warned level."""
    return f'would violate PodSecurity "{level.value}:{version}": {", ".join(found)}'


def forbidden_message(name: str, level: Level, version: str, found: list[str]) -> str:
    """The 403 message of the API server for a pod refused by Pod Security admission."""
    return f'pods "{name}" is forbidden: violates PodSecurity "{level.value}:{version}": {", ".join(found)}'
