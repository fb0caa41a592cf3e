"""The job's secret: one Secret per ElasticJob, and how its worker pods read it (pure builders).

The secret is what proves to an agent's services (its checkpoint service, its peer links)
that a request comes from the same job (docs/security.md). The operator creates it as
``<job>-secret-<the first 8 characters of the job's uid>``: key ``contract.JOB_SECRET_KEY``,
64 lowercase hex digits derived from the operator's master key and the job's uid
(:func:`derived_value`, so that the operator can sign the job's store records without ever
reading the Secret; the master key: :mod:`.masterkey`), ``immutable``, labelled with
the job's name and owned by the job (``controller``), so the garbage collector removes it
with the job. The uid in the name keeps a new job from meeting the Secret of an earlier
job of the same name that the garbage collector has not removed yet.

When it is created, and why never while a pod holds the key: the value is the key of every
agent of the job, so a Secret created afresh while pods that mount it run would give new
pods another key than their peers', splitting the job. The operator therefore asks for the
Secret only in a pass that creates worker pods while no worker pod mounts it (the job's
start, a resume, a restart of every pod, pods made before the job had a Secret): a create
that finds it (409) keeps the value already there, one that does not makes a new one. A
Secret deleted while pods that hold it run is not replaced: those pods keep their copy,
new pods wait for the Secret (the kubelet reports ``FailedMount``) until none is left. The operator needs only
``create`` on the jobs' Secrets: it never reads one (it derives the value again).

Worker pods get it through a projected volume (:func:`secret_volume`), mounted read-only
at ``contract.JOB_SECRET_MOUNT_DIR`` of the worker container only, never as an environment
variable; the agent's ``--job-secret-file`` names the file. The value never enters a
reconcile decision: the executor adds it to the manifest just before the create
(:func:`with_value`), and nothing logs it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from typing import Any

from kelastic.agent import contract
from kelastic.operator.spec import JOB_SECRET_VOLUME, Job

__all__ = [
    "JOB_SECRET_VOLUME",
    "VALUE_BYTES",
    "derived_value",
    "new_value",
    "secret_file_mode",
    "secret_manifest",
    "secret_mount",
    "secret_name",
    "secret_volume",
    "with_value",
]

#: Random bytes in a job's secret (its value is their hex digits).
VALUE_BYTES = 32


def secret_name(job: Job) -> str:
    """``<job>-secret-<8 characters of the uid>``: a job's own name, never an earlier job's."""
    tag = re.sub(r"[^a-z0-9]", "", job.meta.uid.lower())[:8] or "0"
    return f"{job.meta.name}-secret-{tag}"


def new_value() -> str:
    """A fresh secret: 64 lowercase hex digits, 256 bits from the operating system's CSPRNG."""
    return secrets.token_hex(VALUE_BYTES)


#: What a job's secret is derived from, before the job's uid (a use of the master key of its own).
DERIVATION_LABEL = b"kelastic job secret"


def derived_value(master_key: bytes, uid: str) -> str:
    """The secret of the job ``uid``: ``HMAC-SHA256(master key, "kelastic job secret" || uid)``
    as 64 lowercase hex digits. Only a holder of the master key computes it; one job's secret
    tells nothing of another's (the uid is unique per job, never reused)."""
    if not uid:
        raise ValueError("a job's secret is derived from its uid, and this job has none")
    return hmac.new(master_key, DERIVATION_LABEL + uid.encode(), hashlib.sha256).hexdigest()


def secret_manifest(job: Job, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The job's Secret without its value (``owner``: the job's ownerReference)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(job),
            "namespace": job.meta.namespace,
            "labels": {contract.LABEL_JOB_NAME: job.meta.name},
            "ownerReferences": [dict(owner)],
        },
        "type": "Opaque",
        # Nobody changes a running job's key: one that changed under running pods would split the job.
        "immutable": True,
    }


def with_value(manifest: Mapping[str, Any], value: str) -> dict[str, Any]:
    """``manifest`` holding ``value`` under ``contract.JOB_SECRET_KEY``."""
    return {**manifest, "data": {contract.JOB_SECRET_KEY: base64.b64encode(value.encode()).decode()}}


def secret_file_mode(pod_spec: Mapping[str, Any], container: Mapping[str, Any]) -> int:
    """The secret file's mode in the worker container: readable by its user, by no one else where
    the pod says who that is.

    0400 for a container that runs as root (``runAsUser: 0``); 0440 with a pod ``fsGroup`` (the
    kubelet gives the file that group); otherwise the image's own user reads it, whom the pod does
    not name, so 0444. Only the worker container mounts the volume, so "others" are the
    container's own processes (on the node, the kubelet's directory is root's).
    """
    pod_context = pod_spec.get("securityContext") or {}
    own_context = container.get("securityContext") or {}
    user = own_context.get("runAsUser", pod_context.get("runAsUser"))
    if user == 0:
        return 0o400
    if pod_context.get("fsGroup") is not None:
        return 0o440
    return 0o444


def secret_volume(job: Job, mode: int) -> dict[str, Any]:
    """The worker pod's projected volume holding the secret's one key as a file of ``mode``."""
    return {
        "name": JOB_SECRET_VOLUME,
        "projected": {
            "defaultMode": mode,
            "sources": [
                {
                    "secret": {
                        "name": secret_name(job),
                        "items": [{"key": contract.JOB_SECRET_KEY, "path": contract.JOB_SECRET_KEY}],
                    }
                }
            ],
        },
    }


def secret_mount() -> dict[str, Any]:
    """The worker container's read-only mount of :func:`secret_volume`."""
    return {"name": JOB_SECRET_VOLUME, "mountPath": contract.JOB_SECRET_MOUNT_DIR, "readOnly": True}
