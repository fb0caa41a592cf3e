"""A thin, blocking REST client of the Kubernetes API for the operator's writes.

Built on the official client's configuration and connection pool (kubeconfig,
in-cluster service account, TLS, tokens), but speaks plain JSON dicts: no model
classes, so decoding stays cheap when an operator manages hundreds of pods.
Errors raise :class:`ApiError` carrying the HTTP status and the API's message.
Callers run these methods in threads (``asyncio.to_thread``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import date, datetime
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client, config

from kelastic.operator.spec import GROUP, PLURAL, VERSION

__all__ = ["ApiError", "Kube", "load_configuration"]

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "kelastic-operator"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def load_configuration(kubeconfig: str | None = None, context: str | None = None) -> client.Configuration:
    """In-cluster credentials when running in a pod (and no kubeconfig is named), else the kubeconfig."""
    cfg = client.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return cfg
        except config.ConfigException:
            pass
    config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    return cfg


def _json_default(value: Any) -> str:
    if isinstance(value, datetime | date):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_body(body: Any) -> bytes:
    """A request body as JSON bytes (datetimes as ISO 8601, as the official client writes them)."""
    if isinstance(body, bytes):
        return body
    return json.dumps(body, default=_json_default, separators=(",", ":")).encode()


class Kube:
    """JSON-over-HTTP access to the handful of endpoints the operator writes to."""

    def __init__(
        self, configuration: client.Configuration, *, pool_size: int = 16, timeout: float = 30.0
    ) -> None:
        configuration.connection_pool_maxsize = pool_size
        self._api = client.ApiClient(configuration)
        # Named in the API server's logs and audit (and counted apart by bench/bench_operator.py).
        self._api.user_agent = USER_AGENT
        self._timeout = timeout

    def close(self) -> None:
        self._api.close()

    def pod_log(self, namespace: str, name: str, container: str | None, tail_lines: int = 40) -> str:
        """The last ``tail_lines`` lines a pod's container wrote."""
        query = {"tailLines": str(tail_lines)}
        if container:
            query["container"] = container
        raw = self._raw(
            "GET", self.core_path(namespace, "pods", name) + "/log", None, "application/json", query
        )[1]
        return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)

    def _raw(
        self, method: str, path: str, body: Any, content_type: str, query: Mapping[str, str] | None
    ) -> tuple[int, Any, str]:
        headers = {"Accept": "application/json, */*", "Content-Type": content_type}
        # The client only resolves the URL and the credentials: a body is encoded here, once,
        # by the C encoder. Its own path walks the body in Python (sanitize_for_serialization)
        # before encoding it, about a quarter of a millisecond per pod manifest: at 1,000 jobs
        # of 8 pods, seconds of the operator's CPU.
        m, url, hdrs, _, _ = self._api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params=headers,
            auth_settings=["BearerToken"],
        )
        try:
            if body is None:
                answer = self._api.call_api(m, url, header_params=hdrs, _request_timeout=self._timeout)
                status, reason, raw = int(answer.status), str(answer.reason), answer.read()
            else:
                resp = self._api.rest_client.pool_manager.request(
                    m,
                    url,
                    body=encode_body(body),
                    headers=hdrs,
                    timeout=urllib3.Timeout(total=self._timeout),
                )
                status, reason, raw = int(resp.status), str(resp.reason), resp.data
        except client.ApiException as exc:
            raise ApiError(int(exc.status or 0), str(exc.reason or "error"), str(exc.body or exc)) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiError(
                0, "Unreachable", f"{method} {path}: the API server did not answer: {exc}"
            ) from None
        if status >= 400:
            try:
                decoded = json.loads(raw)
            except ValueError:
                decoded = {}
            raise ApiError(status, str(decoded.get("reason") or reason), str(decoded.get("message") or raw))
        return status, raw, reason

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        query: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        raw = self._raw(method, path, body, content_type, query)[1]
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return {"message": raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)}

    # ----------------------------------------------------------------- paths

    @staticmethod
    def core_path(namespace: str, plural: str, name: str | None = None) -> str:
        path = f"/api/v1/namespaces/{quote(namespace)}/{plural}"
        return f"{path}/{quote(name)}" if name else path

    @staticmethod
    def job_path(namespace: str, name: str | None = None) -> str:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{quote(namespace)}/{PLURAL}"
        return f"{path}/{quote(name)}" if name else path

    # ----------------------------------------------------------------- verbs

    def create(self, namespace: str, plural: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", self.core_path(namespace, plural), dict(manifest))

    def dry_run_create(self, namespace: str, plural: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """What creating ``manifest`` would store, with unknown fields refused where the server can
        (``fieldValidation=Strict``; older servers ignore it and prune them). Creates nothing."""
        query = {"dryRun": "All", "fieldValidation": "Strict"}
        return self.request("POST", self.core_path(namespace, plural), dict(manifest), query=query)

    def patch(self, namespace: str, plural: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch of one core object (the operator patches only its own Events)."""
        return self.request(
            "PATCH", self.core_path(namespace, plural, name), dict(patch), content_type=MERGE_PATCH
        )

    def delete(
        self, namespace: str, plural: str, name: str, uid: str | None = None, grace_seconds: int | None = None
    ) -> None:
        """Delete ``name``; with ``uid``, only that incarnation (a replacement of the same name is
        kept); with ``grace_seconds``, that grace period (0: at once, a force delete)."""
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
        }
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        self.request("DELETE", self.core_path(namespace, plural, name), body)

    def serves(self, group_version: str, plural: str) -> bool:
        """Whether discovery lists the resource ``plural`` of ``group_version`` (e.g.
        ``scheduling.k8s.io/v1beta1``, ``podgroups``): False when the group version is not served."""
        try:
            listing = self.request("GET", f"/apis/{group_version}")
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in listing.get("resources") or [])

    def get_namespace(self, name: str) -> dict[str, Any]:
        """The Namespace ``name`` (the operator reads its own, to learn its labels)."""
        return self.request("GET", f"/api/v1/namespaces/{quote(name)}")

    def get_node(self, name: str) -> dict[str, Any] | None:
        """The Node ``name``, None when it does not exist."""
        try:
            return self.request("GET", f"/api/v1/nodes/{quote(name)}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", self.job_path(namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def patch_job_status(self, namespace: str, name: str, status_patch: Mapping[str, Any]) -> dict[str, Any]:
        path = self.job_path(namespace, name) + "/status"
        return self.request("PATCH", path, {"status": dict(status_patch)}, content_type=MERGE_PATCH)

    def delete_job(self, namespace: str, name: str, uid: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
            "preconditions": {"uid": uid},
        }
        self.request("DELETE", self.job_path(namespace, name), body)
