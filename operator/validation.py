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

Jobs are often made from one template (a sweep of 1,000 jobs that differ only in
name): :class:`Passed` lets them share one dry run. Its key is the worker pod the
job would get with its name and uid replaced by stand-ins of the same shape
(:func:`stand_in`), so two jobs share a pass only when their pods differ in nothing
but those names; a pass is kept for ``ttl`` seconds, so a changed admission policy
(a LimitRange, a Pod Security level) is noticed by later jobs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from kelastic.operator import builders
from kelastic.operator.kube import ApiError
from kelastic.operator.spec import API_VERSION, KIND, Job, SpecError
from kelastic.operator.status import TERMINAL_PHASES

__all__ = [
    "TEMPLATE_PATH",
    "Passed",
    "TemplateChecker",
    "dropped_fields",
    "manifest_key",
    "pod_error",
    "stand_in",
    "template_field",
]

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


def _shape(name: str) -> str:
    """``name`` with each letter as ``a`` and each digit as ``0`` (``-`` and ``.`` kept).

    The API server judges names only by their length and characters' classes (DNS
    labels and subdomains, label values), so a name's shape decides what it decides.
    """
    return "".join("a" if c.isalpha() else "0" if c.isdigit() else c for c in name)


def stand_in(job: Job) -> Job:
    """``job`` under a stand-in identity: its name's shape and a uid of zeros of the same length."""
    uid = "".join("0" if c.isalnum() else c for c in job.meta.uid)
    return replace(job, meta=replace(job.meta, name=_shape(job.meta.name), uid=uid, generation=0))


def manifest_key(manifest: Mapping[str, Any]) -> str:
    """A digest of ``manifest`` (canonical JSON): equal manifests, equal keys."""
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class Passed:
    """Pod manifests the API server accepted, by :func:`manifest_key` of the stand-in's pod.

    Only passes are shared: a refusal's message names the job's own pod, so each
    refused job gets its own dry run (and its own words). Bounded (``max_entries``,
    least recently used go first), each entry kept ``ttl`` seconds.
    """

    def __init__(
        self, *, ttl: float = 600.0, max_entries: int = 1024, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._passed: OrderedDict[str, float] = OrderedDict()  # key -> when it passed

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` passed less than ``ttl`` seconds ago."""
        if not isinstance(key, str) or key not in self._passed:
            return False
        if self._clock() - self._passed[key] > self.ttl:
            del self._passed[key]
            return False
        self._passed.move_to_end(key)
        return True

    def add(self, key: str) -> None:
        self._passed[key] = self._clock()
        self._passed.move_to_end(key)
        while len(self._passed) > self.max_entries:
            self._passed.popitem(last=False)

    def __len__(self) -> int:
        return len(self._passed)


#: Runs a blocking call off the event loop: ``await offload(fn, *args)`` is ``fn(*args)``.
Offload = Callable[..., Awaitable[Any]]
#: The API client's dry-run create: ``(namespace, plural, manifest) -> the object it would store``.
DryRunCreate = Callable[[str, str, Mapping[str, Any]], Mapping[str, Any]]

log = logging.getLogger("kelastic.operator")


class TemplateChecker:
    """Judges each job's pod template by a dry run, once per job generation.

    :meth:`check` returns the job as it is, or made invalid (``spec=None`` and the
    :class:`SpecError`) when the API server refuses its first worker pod. Jobs whose
    pods differ only in their names share a pass (:class:`Passed`). A dry run the API
    server did not answer raises :class:`ApiError` (status 0): no pod may be created
    before a verdict, so the caller retries the pass. Any other failure to ask
    (forbidden, quota) is not the template's fault: it is logged and the job passes;
    pod creation reports it.
    """

    def __init__(
        self,
        dry_run_create: DryRunCreate,
        offload: Offload,
        build: builders.BuildConfig,
        *,
        passed: Passed | None = None,
    ) -> None:
        self._dry_run_create = dry_run_create
        self._offload = offload
        self._build = build
        self.passed = passed if passed is not None else Passed()
        #: Per job (namespace, name): the generation judged, and its verdict.
        self._judged: dict[tuple[str, str], tuple[int, SpecError | None]] = {}
        #: Dry runs sent (for tests and benchmarks).
        self.dry_runs = 0
        self._asking: dict[str, asyncio.Event] = {}  # shared key -> set when its dry run is answered

    def forget(self, key: tuple[str, str]) -> None:
        """The job is gone: drop its verdict."""
        self._judged.pop(key, None)

    async def check(self, job: Job) -> Job:
        """``job``, or ``job`` made invalid by the API server's verdict on its pod template."""
        if job.spec is None or job.deleting or job.status.get("phase") in {p.value for p in TERMINAL_PHASES}:
            return job
        key = (job.meta.namespace, job.meta.name)
        judged = self._judged.get(key)
        if judged is None or judged[0] != job.meta.generation:
            judged = self._judged[key] = (job.meta.generation, await self._verdict(job))
        if judged[1] is None:
            return job
        return replace(job, spec=None, error=judged[1])

    async def _verdict(self, job: Job) -> SpecError | None:
        shared = manifest_key(
            builders.worker_pod(stand_in(job), 0, endpoint="127.0.0.1:1", config=self._build)
        )
        # Jobs applied together reach here together: one asks, the others wait for its answer.
        while shared in self._asking:
            await self._asking[shared].wait()
        if shared in self.passed:
            return None
        self._asking[shared] = asyncio.Event()
        try:
            return await self._ask(job, shared)
        finally:
            self._asking.pop(shared).set()

    async def _ask(self, job: Job, shared: str) -> SpecError | None:
        manifest = builders.worker_pod(job, 0, endpoint="127.0.0.1:1", config=self._build)
        # A name no real pod has: a running worker-0 would make the dry run a 409.
        manifest["metadata"]["name"] = f"{job.meta.name}-template-check"

        def dry_run() -> Mapping[str, Any]:
            return self._dry_run_create(job.meta.namespace, "pods", manifest)

        self.dry_runs += 1
        try:
            error: SpecError | None = await self._offload(
                pod_error, manifest, dry_run, ApiError, lambda e: e.status
            )
        except ApiError as err:
            if err.status == 0:
                raise
            ref = {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "namespace": job.meta.namespace,
                "name": job.meta.name,
            }
            log.info(
                "ElasticJob %s/%s: could not validate the pod template: %s",
                job.meta.namespace,
                job.meta.name,
                err,
                extra={"k8s_ref": ref},
            )
            return None
        if error is None:
            self.passed.add(shared)
        return error
