"""How the operator names one ElasticJob: its key, and the log line about it.

Every part of the controller (the passes, the action executor, the store sync)
logs about jobs the same way, ``ElasticJob ns/name: message``, and JSON logs carry
the job as a structured ``object`` as well.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kelastic.operator.spec import API_VERSION, KIND

__all__ = ["JobKey", "job_log", "key_of", "log"]

#: A job's (namespace, name): how the controller, its caches and its queue name it.
JobKey = tuple[str, str]

log = logging.getLogger("kelastic.operator")


def job_log(key: JobKey, level: int, message: str, *, exc_info: bool = False) -> None:
    """Log about one job: ``ElasticJob ns/name: message``; JSON logs also carry it as ``object``."""
    ref = {"apiVersion": API_VERSION, "kind": KIND, "namespace": key[0], "name": key[1]}
    log.log(level, "ElasticJob %s/%s: %s", key[0], key[1], message, exc_info=exc_info, extra={"k8s_ref": ref})


def key_of(body: Mapping[str, Any]) -> JobKey:
    """The key of an ElasticJob object (its metadata's namespace and name)."""
    meta = body.get("metadata") or {}
    return (str(meta.get("namespace")), str(meta.get("name")))
