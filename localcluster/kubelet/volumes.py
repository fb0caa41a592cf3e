"""Pod volumes on one shared filesystem.

Container processes all see the host's filesystem, so a volume cannot be
mounted at its ``mountPath``. kelastic local applies these rules instead:

- ``hostPath``: the real host directory, shared by every pod that names it
  (this is how pods share checkpoints locally). ``mountPath`` must equal
  ``path`` (or lie inside it, as with ``subPath``); a mount that would move the
  directory elsewhere is refused with ``CreateContainerConfigError`` rather than
  silently writing to the wrong place. ``type`` ``DirectoryOrCreate``/``FileOrCreate``
  create it; ``Directory``/``File`` require it.
- ``emptyDir``: a fresh directory per pod under the kubelet's data directory,
  removed with the pod. ``configMap`` and ``secret``: a per-pod directory with
  one file per key, of the item's ``mode`` or the volume's ``defaultMode`` (0644
  without either), as on a node. Their ``mountPath`` is not honoured: the container finds the
  directory in the environment variable ``KELASTIC_VOLUME_<NAME>`` (volume name
  upper-cased, non-alphanumerics as ``_``), usable in ``args`` as
  ``$(KELASTIC_VOLUME_<NAME>)``. A ``mountPath`` that already is that directory
  (or an existing shared one such as ``/dev/shm``) works as written.
- ``projected`` (what current Kubernetes mounts for service-account tokens)
  and ``downwardAPI``: a per-pod directory holding each source's files:
  ``secret``/``configMap`` keys, ``downwardAPI`` fields and
  ``serviceAccountToken`` tokens (requested by the kubelet through
  TokenRequest and passed in ``tokens``).
- ``persistentVolumeClaim``: the claim's directory under the kubelet's data
  directory (``claims/<namespace>/<claimName>``), created on first use and
  shared by every pod that names the claim, like a ReadWriteMany volume; it
  outlives the pods (a local provisioner). Its ``mountPath`` is relocated as
  for emptyDir (see :mod:`kelastic.localcluster.kubelet.images`).
- Other volume kinds are refused with a message naming them.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .podenv import ContainerConfigError, PodContext, field_value
from .satokens import write_atomically

__all__ = ["DEFAULT_FILE_MODE", "mount_env", "prepare_volumes", "token_key", "volume_env_name"]

#: The mode of a configMap, secret, projected or downwardAPI volume's file when neither its
#: item's ``mode`` nor the volume's ``defaultMode`` says one (Kubernetes' default).
DEFAULT_FILE_MODE = 0o644


def volume_env_name(volume: str) -> str:
    return "KELASTIC_VOLUME_" + re.sub(r"[^A-Za-z0-9]", "_", volume).upper()


def _write_files(
    target: Path,
    data: Mapping[str, str],
    decode: bool,
    spec: Mapping[str, Any] | None = None,
    default_mode: int | None = None,
) -> None:
    """Write ``data`` (``path → value``) under ``target``, each file with its mode: the item's
    ``mode`` in ``spec``, else ``default_mode``, else the source's ``defaultMode``, else 0644."""
    target.mkdir(parents=True, exist_ok=True)
    spec = spec or {}
    modes = {
        str(i.get("path", i.get("key", ""))): int(i["mode"])
        for i in spec.get("items") or []
        if isinstance(i, Mapping) and i.get("mode") is not None
    }
    fallback = int(default_mode if default_mode is not None else spec.get("defaultMode", DEFAULT_FILE_MODE))
    for key, value in data.items():
        (target / key).parent.mkdir(parents=True, exist_ok=True)
        content = base64.b64decode(value) if decode else str(value).encode()
        write_atomically(target / key, content, modes.get(key, fallback))


def _key_files(
    kind: str, spec: Mapping[str, Any], objects: Mapping[str, Mapping[str, str]], volume: str
) -> dict[str, str]:
    """The ``path → value`` files of a configMap/secret source (``items`` select and rename keys)."""
    source = spec.get("secretName" if kind == "secret" else "name", "") or spec.get("name", "")
    data = objects.get(source)
    if data is None:
        if spec.get("optional", False):
            return {}
        raise ContainerConfigError(f'{kind} "{source}" not found (volume {volume!r})')
    items = spec.get("items")
    if items:
        return {i.get("path", i["key"]): data[i["key"]] for i in items if i.get("key") in data}
    return dict(data)


def _downward_files(pod: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, str]:
    ctx = PodContext(pod_ip="", node_name=str((pod.get("spec") or {}).get("nodeName", "")))
    files: dict[str, str] = {}
    for item in spec.get("items") or []:
        if item.get("fieldRef"):
            files[item["path"]] = field_value(pod, item["fieldRef"].get("fieldPath", ""), ctx)
    return files


def _projected(
    pod: Mapping[str, Any],
    vol: Mapping[str, Any],
    path: Path,
    configmaps: Mapping[str, Mapping[str, str]],
    secrets: Mapping[str, Mapping[str, str]],
    tokens: Mapping[str, str],
) -> None:
    name = vol.get("name", "")
    spec = vol.get("projected") or {}
    mode = int(spec.get("defaultMode", DEFAULT_FILE_MODE))
    for source in spec.get("sources") or []:
        if "configMap" in source:
            config = source["configMap"] or {}
            _write_files(path, _key_files("configmap", config, configmaps, name), False, config, mode)
        elif "secret" in source:
            secret = source["secret"] or {}
            _write_files(path, _key_files("secret", secret, secrets, name), True, secret, mode)
        elif "downwardAPI" in source:
            downward = source["downwardAPI"] or {}
            _write_files(path, _downward_files(pod, downward), False, downward, mode)
        elif "serviceAccountToken" in source:
            token_path = str((source["serviceAccountToken"] or {}).get("path", "token"))
            token = tokens.get(token_key(name, token_path))
            if token is None:
                raise ContainerConfigError(
                    f"no service-account token for volume {name!r} (path {token_path})"
                )
            _write_files(path, {token_path: token}, False, default_mode=mode)
        else:
            kinds = ", ".join(sorted(source)) or "unknown"
            raise ContainerConfigError(f"projected volume {name!r}: source {kinds} is not supported")


def token_key(volume: str, path: str) -> str:
    """How :func:`prepare_volumes` finds the token of a ``serviceAccountToken`` source in ``tokens``."""
    return f"{volume}/{path}"


def prepare_volumes(
    pod: Mapping[str, Any],
    pod_dir: Path,
    configmaps: Mapping[str, Mapping[str, str]],
    secrets: Mapping[str, Mapping[str, str]],
    tokens: Mapping[str, str] | None = None,
    claims_dir: Path | None = None,
) -> dict[str, Path]:
    """Create the pod's volumes; return the host directory of each, by volume name.

    ``tokens`` holds the service-account tokens of projected volumes, by
    :func:`token_key`. Raises :class:`ContainerConfigError` for an unsupported
    kind or a missing source (the kubelet retries later, as for a missing
    configmap).
    """
    paths: dict[str, Path] = {}
    for vol in (pod.get("spec") or {}).get("volumes") or []:
        name = vol.get("name", "")
        if "emptyDir" in vol:
            path = pod_dir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in vol:
            spec = vol["hostPath"] or {}
            path = Path(spec.get("path", ""))
            kind = spec.get("type", "") or ""
            if kind == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate":
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch(exist_ok=True)
            elif kind == "Directory" and not path.is_dir():
                raise ContainerConfigError(f"hostPath volume {name!r}: {path} is not a directory")
            elif kind == "File" and not path.is_file():
                raise ContainerConfigError(f"hostPath volume {name!r}: {path} is not a file")
        elif "configMap" in vol or "secret" in vol:
            is_secret = "secret" in vol
            spec = vol["secret" if is_secret else "configMap"] or {}
            kind_name = "secret" if is_secret else "configmap"
            data = _key_files(kind_name, spec, secrets if is_secret else configmaps, name)
            path = pod_dir / "volumes" / name
            _write_files(path, data, is_secret, spec)
        elif "projected" in vol:
            path = pod_dir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            _projected(pod, vol, path, configmaps, secrets, tokens or {})
        elif "persistentVolumeClaim" in vol and claims_dir is not None:
            claim = str((vol["persistentVolumeClaim"] or {}).get("claimName", ""))
            if not claim or "/" in claim or claim.startswith("."):
                raise ContainerConfigError(f"volume {name!r}: persistentVolumeClaim needs a claimName")
            path = claims_dir / claim
            path.mkdir(parents=True, exist_ok=True)
        elif "downwardAPI" in vol:
            path = pod_dir / "volumes" / name
            downward = vol["downwardAPI"] or {}
            _write_files(path, _downward_files(pod, downward), False, downward)
        else:
            kinds = sorted(k for k in vol if k != "name")
            raise ContainerConfigError(
                f"volume {name!r} of kind {', '.join(kinds) or 'unknown'} is not supported by kelastic local "
                "(supported: emptyDir, hostPath, configMap, secret, projected, downwardAPI, persistentVolumeClaim)"
            )
        paths[name] = path
    return paths


def mount_env(
    pod: Mapping[str, Any], container: Mapping[str, Any], volumes: Mapping[str, Path]
) -> dict[str, str]:
    """Environment variables naming the container's mounted volumes; checks hostPath mounts."""
    host_paths = {
        v.get("name"): Path((v.get("hostPath") or {}).get("path", ""))
        for v in (pod.get("spec") or {}).get("volumes") or []
        if "hostPath" in v
    }
    env: dict[str, str] = {}
    for mount in container.get("volumeMounts") or []:
        name = mount.get("name", "")
        if name not in volumes:
            raise ContainerConfigError(
                f"container {container.get('name')!r} mounts volume {name!r}, which the pod does not declare"
            )
        source = volumes[name] / mount["subPath"] if mount.get("subPath") else volumes[name]
        if name in host_paths:
            wanted = Path(mount.get("mountPath", ""))
            if wanted != source and source not in wanted.parents:
                raise ContainerConfigError(
                    f"hostPath volume {name!r} is mounted at {wanted} but is {source} on the host; "
                    "kelastic local runs containers on the host filesystem, so set mountPath to the "
                    "hostPath path (or a path inside it)"
                )
        env[volume_env_name(name)] = str(source)
    return env
