"""The endpoints controller: keeps each Service's EndpointSlices current.

For every Service with a selector, the EndpointSlices of the Service list
the pods the selector matches that have an IP and are not terminating or
finished: ready pods under ``addresses``, the others under
``notReadyAddresses`` (or under ``addresses`` when the service sets
``publishNotReadyAddresses``), with each service port resolved to the pod's
port (named ``targetPort`` looked up in the pod's container ports). Pods whose
ports resolve alike share one subset. Headless services (``clusterIP: None``)
are handled the same way: their endpoints list the pod IPs. Services without a
selector are left alone. The addresses are published as EndpointSlices
(``discovery.k8s.io/v1``, one per port set, owned by the Service), which is
what ``kubectl describe service`` and the service proxy read. No Endpoints
object is written: like the real API server, the emulator refuses loopback
addresses in Endpoints, and every pod here has one (``127.1.x.y``). The
:func:`compute_subsets` grouping is kept as the step before the slices.

:func:`compute_subsets` is the pure rule; :class:`EndpointsController` applies
it through the API on every service or pod change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ..common.client import ApiClient, ApiRequestError, Informer

__all__ = ["EndpointsController", "compute_slices", "compute_subsets", "pod_is_ready", "selector_matches"]

log = logging.getLogger(__name__)


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str] | None) -> bool:
    """A Service selector (equality on every key) against a pod's labels."""
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _target_port(port: Mapping[str, Any], pod: Mapping[str, Any]) -> int | None:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for cport in container.get("ports") or []:
            if cport.get("name") == target and cport.get("protocol", "TCP") == port.get("protocol", "TCP"):
                return int(cport["containerPort"])
    return None


def compute_subsets(service: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``subsets`` of the service's Endpoints, deterministic (sorted) for comparison."""
    spec = service.get("spec") or {}
    selector = spec.get("selector") or {}
    namespace = (service.get("metadata") or {}).get("namespace", "default")
    publish_not_ready = bool(spec.get("publishNotReadyAddresses"))
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        if meta.get("namespace", "default") != namespace or not selector_matches(
            selector, meta.get("labels")
        ):
            continue
        ip = status.get("podIP")
        if not ip or status.get("phase") in ("Succeeded", "Failed"):
            continue
        if meta.get("deletionTimestamp") and not publish_not_ready:
            continue
        ports: list[dict[str, Any]] = []
        for port in spec.get("ports") or []:
            number = _target_port(port, pod)
            if number is None:
                continue
            entry: dict[str, Any] = {"port": number, "protocol": port.get("protocol", "TCP")}
            if port.get("name"):
                entry["name"] = port["name"]
            ports.append(entry)
        if spec.get("ports") and not ports:
            continue
        address: dict[str, Any] = {
            "ip": ip,
            "targetRef": {
                "kind": "Pod",
                "namespace": namespace,
                "name": meta.get("name"),
                "uid": meta.get("uid"),
            },
        }
        if (pod.get("spec") or {}).get("nodeName"):
            address["nodeName"] = pod["spec"]["nodeName"]
        key = tuple(sorted((p.get("name", ""), p["port"], p["protocol"]) for p in ports))
        subset = groups.setdefault(key, {"addresses": [], "notReadyAddresses": [], "ports": ports})
        ready = pod_is_ready(pod) or publish_not_ready
        subset["addresses" if ready else "notReadyAddresses"].append(address)
    subsets = []
    for key in sorted(groups):
        subset = groups[key]
        out: dict[str, Any] = {}
        for field in ("addresses", "notReadyAddresses"):
            if subset[field]:
                out[field] = sorted(subset[field], key=lambda a: (a["ip"], a["targetRef"]["name"]))
        if out:
            out["ports"] = sorted(subset["ports"], key=lambda p: (p.get("name", ""), p["port"]))
            subsets.append(out)
    return subsets


SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "endpointslice-controller.k8s.io"


def compute_slices(service: Mapping[str, Any], subsets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The EndpointSlices (discovery.k8s.io/v1) equivalent to ``subsets``: one per port set.

    What ``kubectl describe service`` and slice-aware clients read. Each slice is
    owned by the Service, so deleting the Service removes its slices.
    """
    meta = service.get("metadata") or {}
    name = meta.get("name", "")
    owner = {
        "apiVersion": "v1",
        "kind": "Service",
        "name": name,
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }
    groups = subsets or [{"ports": []}]
    slices: list[dict[str, Any]] = []
    for index, subset in enumerate(groups):
        endpoints: list[dict[str, Any]] = []
        for field, ready in (("addresses", True), ("notReadyAddresses", False)):
            for address in subset.get(field) or []:
                endpoint: dict[str, Any] = {
                    "addresses": [address["ip"]],
                    "conditions": {"ready": ready, "serving": ready, "terminating": False},
                    "targetRef": address["targetRef"],
                }
                if address.get("nodeName"):
                    endpoint["nodeName"] = address["nodeName"]
                endpoints.append(endpoint)
        slices.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-kl{index}",
                    "namespace": meta.get("namespace", "default"),
                    "labels": {SERVICE_NAME_LABEL: name, MANAGED_BY_LABEL: MANAGED_BY},
                    "ownerReferences": [owner],
                },
                "addressType": "IPv4",
                "endpoints": sorted(endpoints, key=lambda e: e["addresses"][0]),
                # ``name`` is always present ("" for an unnamed port): kubectl dereferences it.
                "ports": [
                    {"name": p.get("name", ""), "port": p["port"], "protocol": p.get("protocol", "TCP")}
                    for p in subset.get("ports") or []
                ],
            }
        )
    return slices


def _cache_was_behind(exc: BaseException) -> bool:
    return isinstance(exc, ApiRequestError) and exc.status in (404, 409)


class EndpointsController:
    """Writes EndpointSlices for every selector Service; start and stop in one event loop."""

    def __init__(self, client: ApiClient) -> None:
        self.client = client
        self.services = Informer(client, "/api/v1/services", self._on_service)
        self.pods = Informer(client, "/api/v1/pods", self._on_pod)
        #: None when the API server does not serve discovery.k8s.io/v1.
        self.slices: Informer | None = None
        #: Pod UIDs each service lists now, to notice a pod leaving a service.
        self._members: dict[str, set[str]] = {}
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Seconds before a service whose slices could not be written is tried again.
        self.retry_delay = 0.5

    def _informers(self) -> list[Informer]:
        return [i for i in (self.services, self.pods, self.slices) if i is not None]

    async def start(self, timeout: float = 30.0) -> None:
        try:
            await self.client.get("/apis/discovery.k8s.io/v1")
            self.slices = Informer(client=self.client, path="/apis/discovery.k8s.io/v1/endpointslices")
            self.slices.add_callback(self._on_slice)
        except ApiRequestError as exc:
            if exc.status != 404:
                raise
            log.warning("the API server serves no discovery.k8s.io/v1: services get no endpoints")
        for informer in self._informers():
            informer.start()
        try:
            await asyncio.wait_for(asyncio.gather(*(i.synced.wait() for i in self._informers())), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the endpoints controller could not list services, pods and endpoint slices within {timeout}s"
            ) from None
        self._dirty.update(self.services.cache)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="endpoints controller")
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for informer in self._informers():
            await informer.stop()

    def _mark(self, key: str) -> None:
        self._dirty.add(key)
        self._wake.set()

    def _on_service(self, etype: str, key: str, obj: dict[str, Any]) -> None:
        self._mark(key)

    def _on_owned(self, etype: str, key: str, obj: dict[str, Any]) -> None:
        # Our own writes come back here and find nothing to do; anyone else's
        # change to a service's slices is repaired.
        if key in self.services.cache:
            self._mark(key)

    def _on_slice(self, etype: str, key: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if service:
            self._on_owned(etype, f"{meta.get('namespace', 'default')}/{service}", obj)

    def _on_pod(self, etype: str, key: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        ns = meta.get("namespace", "default")
        uid = meta.get("uid", "")
        for skey, svc in self.services.cache.items():
            selector = (svc.get("spec") or {}).get("selector")
            if not selector or not skey.startswith(ns + "/"):
                continue
            # Services the pod belongs to now, and those that list it still (its
            # labels changed or it is gone).
            if selector_matches(selector, meta.get("labels")) or uid in self._members.get(skey, ()):
                self._mark(skey)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            for key in sorted(dirty):
                try:
                    await self._sync(key)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # A conflict or a missing slice means our cache was behind (someone
                    # changed the slice, or the garbage collector took it with its
                    # deleted Service): the watch catches up, then we retry.
                    level = logging.DEBUG if _cache_was_behind(exc) else logging.WARNING
                    log.log(level, "could not update endpoints %s: %s", key, exc)
                    self._dirty.add(key)
            if self._dirty:
                await asyncio.sleep(self.retry_delay)
                self._wake.set()

    async def _sync(self, key: str) -> None:
        service = self.services.cache.get(key)
        if service is None or not (service.get("spec") or {}).get("selector"):
            # No selector: the slices are the user's. A deleted Service's slices
            # go with it (they are owned by it).
            self._members.pop(key, None)
            return
        subsets = compute_subsets(service, self.pods.cache.values())
        self._members[key] = {
            a["targetRef"]["uid"]
            for subset in subsets
            for field in ("addresses", "notReadyAddresses")
            for a in subset.get(field) or []
        }
        if self.slices is not None:
            await self._sync_slices(service, subsets)

    async def _sync_slices(self, service: Mapping[str, Any], subsets: list[dict[str, Any]]) -> None:
        assert self.slices is not None
        meta = service["metadata"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        collection = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
        existing = {
            s["metadata"]["name"]: s
            for s in self.slices.cache.values()
            if s["metadata"].get("namespace") == ns
            and (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) == name
            and (s["metadata"].get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY
        }
        for desired in compute_slices(service, subsets):
            slice_name = desired["metadata"]["name"]
            current = existing.pop(slice_name, None)
            if current is None:
                await self.client.post(collection, desired)
            elif any(current.get(f) != desired.get(f) for f in ("endpoints", "ports", "addressType")):
                desired["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                await self.client.put(f"{collection}/{slice_name}", desired)
        for stale in existing:
            with contextlib.suppress(ApiRequestError):
                await self.client.delete(f"{collection}/{stale}")
