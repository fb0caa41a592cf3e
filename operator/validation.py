"""Server-side validation of a job's pod template, before any pod is created.

The CRD keeps ``replicaSpecs.Worker.template`` as free-form (the pod schema is the
API server's), so a typo such as ``resource:`` for ``resources:`` would pass
``kubectl apply`` and be dropped silently when the pods are created. The operator
therefore asks the API server about the first worker pod once per job generation:

- a dry-run create with ``fieldValidation=Strict``: an API server that supports it
  (Kubernetes 1.25+) refuses unknown fields with ``strict decoding error: unknown
  field "spec.containers[0].resource"``;
- an older API server ignores that parameter and prunes unknown fields; the fields
  the dry run's answer lacks are the unknown ones (:func:`dropped_fields`).

Either way, and for a pod the API server finds invalid (422), the job gets a
:class:`~kelastic.operator.spec.SpecError` naming the field in the ElasticJob
(``spec.replicaSpecs.Worker.template.spec.containers[0].resource``), which the
reconciler turns into an ``InvalidSpec`` condition and Event.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from kelastic.operator.spec import SpecError

__all__ = ["TEMPLATE_PATH", "dropped_fields", "pod_error", "template_field"]

TEMPLATE_PATH = "spec.replicaSpecs.Worker.template"

_STRICT_FIELD = re.compile(r'unknown field "([^"]+)"')


def template_field(pod_field: str) -> str:
    """A field of the worker pod as a field of the ElasticJob (``spec.x`` → ``…template.spec.x``)."""
    return f"{TEMPLATE_PATH}.{pod_field}"


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def dropped_fields(sent: Any, returned: Any, path: str = "") -> list[str]:
    """Fields of ``sent`` that ``returned`` lacks (pruned as unknown), as ``a.b[0].c`` paths.

    Empty values are not reported (a server may leave out an empty map or list).
    """
    out: list[str] = []
    if isinstance(sent, Mapping) and isinstance(returned, Mapping):
        for key, value in sent.items():
            sub = f"{path}.{key}" if path else str(key)
            if key not in returned:
                if not _empty(value):
                    out.append(sub)
            else:
                out += dropped_fields(value, returned[key], sub)
    elif isinstance(sent, list) and isinstance(returned, list) and len(sent) == len(returned):
        for i, (a, b) in enumerate(zip(sent, returned, strict=True)):
            out += dropped_fields(a, b, f"{path}[{i}]")
    return out


def pod_error(
    sent: Mapping[str, Any],
    dry_run: Callable[[], Mapping[str, Any]],
    error_type: type[Exception],
    status_of: Callable[[Exception], int],
) -> SpecError | None:
    """Run ``dry_run`` (the dry-run create of ``sent``); the template's error, or None if it is fine.

    ``error_type`` is the API client's error (``status_of`` reads its HTTP code);
    errors other than 400 and 422 (unreachable server, forbidden, quota) are not
    the template's and propagate.
    """
    try:
        returned = dry_run()
    except error_type as exc:
        status = status_of(exc)
        if status not in (400, 422):
            raise
        text = str(exc)
        unknown = _STRICT_FIELD.findall(text)
        if unknown:
            return _unknown(unknown, "would drop")
        return SpecError(TEMPLATE_PATH, f"the API server refuses the worker pod: {text}")
    dropped = [f for f in dropped_fields(sent, returned) if not f.startswith("status")]
    return _unknown(dropped, "dropped") if dropped else None


def _unknown(pod_fields: list[str], verb: str) -> SpecError:
    others = [template_field(f) for f in pod_fields[1:]]
    also = f" (and {', '.join(others)})" if others else ""
    return SpecError(
        template_field(pod_fields[0]),
        f"is not a field of a pod{also}: the API server {verb} it; fix the spelling "
        "(e.g. resources, not resource)",
    )
