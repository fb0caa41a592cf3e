"""The operator's master key: one Secret in the operator's namespace, read at start-up.

Every job's secret is derived from it (:func:`kelastic.operator.jobsecret.derived_value`), so
the operator can sign any job's store records at any time without reading the job's Secret.
The Secret (default :data:`SECRET_NAME`, key :data:`KEY`, 64 hex digits, ``immutable``) is
read once when the operator starts, and created with a fresh value when it does not exist;
when two replicas create it at once, the one that gets 409 reads what the other wrote. The
operator needs ``get`` on that one Secret and ``create`` on Secrets in its namespace (the
chart's Role). Whoever reads it can compute every job's secret: it is as sensitive as all of
them together. Deleting it makes the operator create a new one at its next start: the jobs
running then keep their Secrets, which the new key no longer derives (docs/security.md says
what that means for them).
"""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

from kelastic.operator.jobsecret import new_value
from kelastic.operator.kube import ApiError, Kube

__all__ = ["KEY", "MIN_BYTES", "SECRET_NAME", "MasterKeyError", "load_or_create"]

log = logging.getLogger(__name__)

#: The master key's Secret in the operator's namespace (``--key-secret``).
SECRET_NAME = "kelastic-operator-key"
#: Its data key.
KEY = "master-key"
#: The shortest master key taken (what :func:`~kelastic.operator.jobsecret.new_value` writes is 64).
MIN_BYTES = 32


class MasterKeyError(Exception):
    """The master key can be neither read nor created; the message says what to do."""


def load_or_create(kube: Kube, namespace: str, name: str = SECRET_NAME) -> bytes:
    """The master key from the Secret ``namespace/name``, created first when it does not exist."""
    where = f"Secret {namespace}/{name}"
    secret = _get(kube, namespace, name, where)
    if secret is None:
        try:
            kube.create(namespace, "secrets", _manifest(namespace, name, new_value()))
            log.info("created the operator's master key in %s", where)
        except ApiError as err:
            if err.status != 409:  # 409: another replica made it meanwhile: read that one
                raise MasterKeyError(_denied(where, "create", err)) from err
        secret = _get(kube, namespace, name, where)
        if secret is None:
            raise MasterKeyError(f"{where} was created but cannot be read back; is something deleting it?")
    return _value(secret, where)


def _get(kube: Kube, namespace: str, name: str, where: str) -> dict[str, Any] | None:
    try:
        return kube.request("GET", kube.core_path(namespace, "secrets", name))
    except ApiError as err:
        if err.status == 404:
            return None
        raise MasterKeyError(_denied(where, "get", err)) from err


def _value(secret: dict[str, Any], where: str) -> bytes:
    raw = (secret.get("data") or {}).get(KEY)
    try:
        value = base64.b64decode(raw or "", validate=True).strip()
    except (binascii.Error, ValueError):
        value = b""
    if len(value) < MIN_BYTES:
        raise MasterKeyError(
            f"{where} holds no master key of at least {MIN_BYTES} bytes under {KEY!r}; delete it and the "
            "operator creates a new one at its next start (the jobs running then keep their own secrets)"
        )
    return value


def _denied(where: str, verb: str, err: ApiError) -> str:
    return (
        f"cannot {verb} the operator's master key, {where}: {err.status} {err.reason}: {err.message}. The "
        "operator needs get on that Secret and create on Secrets in its namespace (the chart's Role grants them)"
    )


def _manifest(namespace: str, name: str, value: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/component": "kelastic-operator-key"},
        },
        "type": "Opaque",
        # A new key would no longer derive the running jobs' secrets: nobody changes it in place.
        "immutable": True,
        "data": {KEY: base64.b64encode(value.encode()).decode()},
    }
