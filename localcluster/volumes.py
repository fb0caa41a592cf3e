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
  one file per key. Their ``mountPath`` is not honoured: the container finds the
  directory in the environment variable ``KELASTIC_VOLUME_<NAME>`` (volume name
  upper-cased, non-alphanumerics as ``_``), usable in ``args`` as
  ``$(KELASTIC_VOLUME_<NAME>)``. A ``mountPath`` that already is that directory
  (or an existing shared one such as ``/dev/shm``) works as written.
- Other volume kinds are refused with a message naming them.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .podenv import ContainerConfigError

__all__ = ["mount_env", "prepare_volumes", "volume_env_name"]


def volume_env_name(volume: str) -> str:
    return "KELASTIC_VOLUME_" + re.sub(r"[^A-Za-z0-9]", "_", volume).upper()


def _write_files(target: Path, data: Mapping[str, str], decode: bool) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for key, value in data.items():
        (target / key).write_bytes(base64.b64decode(value) if decode else str(value).encode())


def prepare_volumes(
    pod: Mapping[str, Any],
    pod_dir: Path,
    configmaps: Mapping[str, Mapping[str, str]],
    secrets: Mapping[str, Mapping[str, str]],
) -> dict[str, Path]:
    """Create the pod's volumes; return the host directory of each, by volume name.

    Raises :class:`ContainerConfigError` for an unsupported kind or a missing
    source (the kubelet retries later, as for a missing configmap).
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
            source = spec.get("secretName" if is_secret else "name", "")
            data = (secrets if is_secret else configmaps).get(source)
            if data is None:
                if spec.get("optional", False):
                    data = {}
                else:
                    kind_name = "secret" if is_secret else "configmap"
                    raise ContainerConfigError(f'{kind_name} "{source}" not found (volume {name!r})')
            items = spec.get("items")
            if items:
                data = {i.get("path", i["key"]): data[i["key"]] for i in items if i.get("key") in data}
            path = pod_dir / "volumes" / name
            _write_files(path, data, decode=is_secret)
        else:
            kinds = sorted(k for k in vol if k != "name")
            raise ContainerConfigError(
                f"volume {name!r} of kind {', '.join(kinds) or 'unknown'} is not supported by kelastic local "
                "(supported: emptyDir, hostPath, configMap, secret)"
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
