"""The kubeconfigs a container gets in place of service-account files it cannot mount:
one with its token (written, and rewritten in place when the token is refreshed), or an
empty one for a container without credentials (so no client falls back to the user's)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from .satokens import write_atomically

__all__ = [
    "SERVICE_ACCOUNT_KUBECONFIG",
    "rewrite_token_kubeconfig",
    "write_empty_kubeconfig",
    "write_token_kubeconfig",
]

#: The kubeconfig (in the pod's directory) that hands a container its service-account token.
SERVICE_ACCOUNT_KUBECONFIG = "serviceaccount.kubeconfig"


def write_empty_kubeconfig(path: Path) -> Path:
    """A kubeconfig with no cluster and no user (clients that read it fail saying so)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        empty = {"apiVersion": "v1", "kind": "Config", "clusters": [], "contexts": [], "users": []}
        path.write_text(json.dumps(empty) + "\n")
    return path


def write_token_kubeconfig(path: Path, server: str, token: str, ca_file: Path | None, namespace: str) -> None:
    """A kubeconfig that authenticates with ``token`` (mode 0600)."""
    cluster: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_file.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "in-cluster", "cluster": cluster}],
        "users": [{"name": "service-account", "user": {"token": token}}],
        "contexts": [
            {
                "name": "in-cluster",
                "context": {"cluster": "in-cluster", "user": "service-account", "namespace": namespace},
            }
        ],
        "current-context": "in-cluster",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(config, indent=1))


def rewrite_token_kubeconfig(path: Path, old: str, new: str) -> None:
    """Put token ``new`` in place of ``old`` in a kubeconfig of :func:`write_token_kubeconfig`."""
    config = json.loads(path.read_text())
    for user in config.get("users") or []:
        if (user.get("user") or {}).get("token") == old:
            user["user"]["token"] = new
    write_atomically(path, json.dumps(config, indent=1))
