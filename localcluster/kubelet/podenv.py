"""What a container process is started with: its environment and its argv.

Pure functions (no I/O) that turn a pod and one of its containers into the
environment variables and command line of the local process that plays the
container, following the Kubernetes rules:

- ``envFrom`` sources first (in order, with their ``prefix``), then ``env`` in
  order; a later definition of a name wins.
- ``value`` strings, ``command`` and ``args`` get ``$(VAR)`` expansion against the
  variables defined so far (``$$`` is a literal ``$``; an undefined reference is
  left as written).
- ``valueFrom``: ``fieldRef`` (``metadata.name``, ``metadata.namespace``,
  ``metadata.uid``, ``metadata.labels``/``metadata.annotations`` and their
  ``['key']`` forms, ``status.podIP``, ``status.podIPs``, ``status.hostIP``,
  ``spec.nodeName``, ``spec.serviceAccountName``), ``configMapKeyRef``,
  ``secretKeyRef`` and ``resourceFieldRef`` (the limit if set, else the
  machine's capacity: resources are not enforced locally).

Containers are processes of the current Python environment, not images: a
container whose ``command`` is empty runs its ``args`` as the command line (the
image's entrypoint is unknown), and ``python``/``python3`` mean the interpreter
that runs the kubelet.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ContainerConfigError",
    "PodContext",
    "expand",
    "field_value",
    "python_or",
    "resolve_command",
    "resolve_env",
    "without_credentials",
]

# Names that mean "the Python of this environment" in a container's argv[0].
_PYTHON_NAMES = re.compile(r"^python(3(\.\d+)?)?$")
_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['([^']*)'\]$")


class ContainerConfigError(ValueError):
    """The container cannot be configured (the kubelet reports ``CreateContainerConfigError``)."""


@dataclass(frozen=True)
class PodContext:
    """Everything outside the pod object that the environment may refer to.

    ``configmaps`` and ``secrets`` map a name (in the pod's namespace) to the
    object's ``data`` (secrets: base64 strings, as served by the API). A name
    absent from the mapping is treated as not existing.
    """

    pod_ip: str
    node_name: str
    host_ip: str = "127.0.0.1"
    configmaps: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    secrets: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: Variables the kubelet itself provides (e.g. ``HOSTNAME``); visible to ``$(VAR)``
    #: expansion and overridable by the container's own definitions.
    provided: Mapping[str, str] = field(default_factory=dict)


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Expand ``$(NAME)`` references in ``text`` the way Kubernetes does.

    ``$$`` yields ``$`` (so ``$$(NAME)`` stays literally ``$(NAME)``); a reference
    to an undefined name, or an unterminated ``$(``, is kept as written.
    """
    out: list[str] = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:
                out.append(text[i:])
                break
            name = text[i + 2 : end]
            out.append(variables[name] if name in variables else text[i : end + 1])
            i = end + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _format_map(values: Mapping[str, str]) -> str:
    # The downward API renders a whole map as sorted key="value" lines.
    return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))


def field_value(pod: Mapping[str, Any], path: str, ctx: PodContext) -> str:
    """The value of a ``fieldRef`` path (env variables and downwardAPI volume files)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", "default"),
        "metadata.uid": meta.get("uid", ""),
        "status.podIP": ctx.pod_ip,
        "status.podIPs": ctx.pod_ip,
        "status.hostIP": ctx.host_ip,
        "status.hostIPs": ctx.host_ip,
        "spec.nodeName": spec.get("nodeName") or ctx.node_name,
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
    }
    if path in simple:
        return str(simple[path])
    if path in ("metadata.labels", "metadata.annotations"):
        return _format_map(meta.get(path.split(".", 1)[1]) or {})
    keyed = _FIELD_KEY.match(path)
    if keyed:
        return str((meta.get(keyed.group(1)) or {}).get(keyed.group(2), ""))
    raise ContainerConfigError(
        f"unsupported fieldRef fieldPath {path!r}; supported: {', '.join(sorted(simple))}, "
        "metadata.labels, metadata.annotations and their ['key'] forms"
    )


def _resource_value(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    resource = ref.get("resource", "")
    section, _, name = resource.partition(".")
    value = ((container.get("resources") or {}).get(section) or {}).get(name)
    if value is not None:
        return str(value)
    # Nothing is enforced locally: report the machine's capacity, as a real node
    # reports allocatable for an unset limit.
    if name == "cpu":
        return str(os.cpu_count() or 1)
    if name == "memory":
        try:
            return str(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return "0"
    if name == "ephemeral-storage":
        return str(shutil.disk_usage("/").total)
    raise ContainerConfigError(f"unsupported resourceFieldRef resource {resource!r}")


def _decode_secret(value: str) -> str:
    return base64.b64decode(value).decode("utf-8", errors="replace")


def _key_ref(
    kind: str, ref: Mapping[str, Any], objects: Mapping[str, Mapping[str, str]], decode: bool
) -> str | None:
    name = ref.get("name", "")
    key = ref.get("key", "")
    optional = bool(ref.get("optional", False))
    data = objects.get(name)
    if data is None:
        if optional:
            return None
        raise ContainerConfigError(f'{kind} "{name}" not found')
    if key not in data:
        if optional:
            return None
        raise ContainerConfigError(f"couldn't find key {key} in {kind} {name}")
    return _decode_secret(data[key]) if decode else str(data[key])


def resolve_env(pod: Mapping[str, Any], container: Mapping[str, Any], ctx: PodContext) -> dict[str, str]:
    """Return the variables the container defines, in definition order.

    The result holds ``ctx.provided`` overlaid with ``envFrom`` and ``env``; the
    caller adds it on top of the base process environment. Raises
    :class:`ContainerConfigError` naming the missing object or key, or the
    unsupported field.
    """
    env: dict[str, str] = dict(ctx.provided)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, objects, decode, ref in (
            ("configmap", ctx.configmaps, False, source.get("configMapRef")),
            ("secret", ctx.secrets, True, source.get("secretRef")),
        ):
            if ref is None:
                continue
            data = objects.get(ref.get("name", ""))
            if data is None:
                if ref.get("optional", False):
                    continue
                raise ContainerConfigError(f'{kind} "{ref.get("name", "")}" not found')
            for key, raw in data.items():
                env[prefix + key] = _decode_secret(raw) if decode else str(raw)
    for var in container.get("env") or []:
        name = var.get("name")
        if not name:
            raise ContainerConfigError(f"container {container.get('name')!r}: env entry without a name")
        if "valueFrom" not in var:
            env[name] = expand(str(var.get("value", "")), env)
            continue
        source = var["valueFrom"] or {}
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, source["fieldRef"].get("fieldPath", ""), ctx)
        elif "resourceFieldRef" in source:
            value = _resource_value(container, source["resourceFieldRef"])
        elif "configMapKeyRef" in source:
            value = _key_ref("configmap", source["configMapKeyRef"], ctx.configmaps, decode=False)
        elif "secretKeyRef" in source:
            value = _key_ref("secret", source["secretKeyRef"], ctx.secrets, decode=True)
        else:
            raise ContainerConfigError(f"env {name!r}: valueFrom names no supported source")
        if value is not None:
            env[name] = value
    return env


def without_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """The kubelet's environment minus what names its own cluster and identity.

    Containers start from the environment of ``kelastic local`` (they run in its
    Python environment), but its ``KUBECONFIG`` (often an admin one, perhaps of a
    real cluster) and the ``KUBERNETES_*`` variables of a cluster it may itself run
    in are not the pod's: a pod gets only the credentials its spec asks for.
    """
    return {k: v for k, v in environ.items() if k != "KUBECONFIG" and not k.startswith("KUBERNETES_")}


def resolve_command(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """Return the argv of the container process.

    ``command`` + ``args`` after ``$(VAR)`` expansion against ``env``; with no
    ``command``, ``args`` alone is the command line. argv[0] is resolved in the
    current Python environment (see :func:`python_or`). Raises
    :class:`ContainerConfigError` when there is nothing to run.
    """
    command = [expand(str(a), env) for a in container.get("command") or []]
    args = [expand(str(a), env) for a in container.get("args") or []]
    argv = command + args
    if not argv:
        raise ContainerConfigError(
            f"container {container.get('name')!r} has neither command nor args: kelastic local runs "
            "processes, not images, so give the command line to run (e.g. command: [python, train.py])"
        )
    argv[0] = python_or(argv[0])
    return argv


def python_or(command: str) -> str:
    """Resolve a container's argv[0] in the current Python environment.

    ``python``, ``python3`` and ``python3.X`` become :data:`sys.executable`; a bare
    name of a console script installed in this environment (``kelastic-agent``,
    ``kelastic-rendezvous``, ...) becomes its full path, because an image's entry
    points are this environment's scripts here, wherever ``PATH`` points. Any other
    command is returned unchanged (and looked up on the container's ``PATH``).
    """
    if _PYTHON_NAMES.match(command):
        return sys.executable
    if "/" not in command:
        script = os.path.join(sysconfig.get_path("scripts"), command)
        if os.path.isfile(script) and os.access(script, os.X_OK):
            return script
    return command
