"""Unit tests of the API server's routing (a path to what it names) and of the request
options every handler reads (tested with aiohttp's own request objects, no server)."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from kelastic.localcluster.apiserver import httpio
from kelastic.localcluster.apiserver.errors import ApiError
from kelastic.localcluster.apiserver.registry_types import FieldValidation
from kelastic.localcluster.apiserver.resources import TypeRegistry
from kelastic.localcluster.apiserver.routing import EndpointKind, resolve

TYPES = TypeRegistry()


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/healthz", EndpointKind.HEALTH),
        ("/readyz/ping", EndpointKind.HEALTH),
        ("/version", EndpointKind.VERSION),
        ("/api", EndpointKind.CORE_VERSIONS),
        ("/apis/", EndpointKind.GROUPS),
        ("/apis/apps", EndpointKind.GROUP),
        ("/api/v1", EndpointKind.RESOURCES),
        ("/apis/apps/v1", EndpointKind.RESOURCES),
        ("/openapi/v3/apis/apps/v1", EndpointKind.OPENAPI),
        ("/api/v1/pods", EndpointKind.RESOURCE),
    ],
)
def test_what_a_path_names(path: str, kind: EndpointKind) -> None:
    assert resolve(TYPES, path).kind is kind


def test_a_resource_route() -> None:
    route = resolve(TYPES, "/api/v1/namespaces/ns/pods/p/status").route
    assert route is not None
    assert (route.rt.plural, route.namespace, route.name, route.sub, route.watch_path) == (
        "pods",
        "ns",
        "p",
        "status",
        False,
    )
    watch = resolve(TYPES, "/apis/apps/v1/watch/namespaces/ns/deployments").route
    assert watch is not None and watch.watch_path and watch.namespace == "ns" and watch.name is None
    # A namespace's own subresources are not a namespaced path.
    finalize = resolve(TYPES, "/api/v1/namespaces/ns/finalize").route
    assert finalize is not None and (finalize.rt.plural, finalize.name, finalize.sub) == (
        "namespaces",
        "ns",
        "finalize",
    )


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/nothing",
        "/api/v1/gadgets",
        "/api/v1/namespaces/ns/nodes/n",  # nodes are cluster-scoped
        "/api/v1/pods/p/exec",  # not a served subresource
        "/api/v1/namespaces/ns/pods/p/status/more",
        "/api/v1/watch",
    ],
)
def test_a_path_that_names_nothing_is_404(path: str) -> None:
    with pytest.raises(ApiError) as caught:
        resolve(TYPES, path)
    assert caught.value.code == 404 and "could not find the requested resource" in caught.value.message


def request(method: str, query: str = "", headers: dict[str, str] | None = None) -> Any:
    return make_mocked_request(method, "/api/v1/pods" + (f"?{query}" if query else ""), headers=headers or {})


def test_request_options() -> None:
    assert httpio.field_validation(request("POST", "fieldValidation=Strict")) is FieldValidation.STRICT
    assert httpio.field_validation(request("POST")) is FieldValidation.WARN
    with pytest.raises(ApiError) as caught:
        httpio.field_validation(request("PUT", "fieldValidation=Loose"))
    assert caught.value.code == 422
    assert httpio.field_manager(request("PUT", headers={"User-Agent": "kubectl/v1.37 (linux)"})) == "kubectl"
    assert httpio.field_manager(request("PUT", "fieldManager=me")) == "me"
    assert httpio.dry_run(request("POST", "dryRun=All")) and not httpio.dry_run(request("POST"))
    with pytest.raises(ApiError):
        httpio.dry_run(request("POST", "dryRun=Some"))
    assert httpio.int_param("", "limit") is None and httpio.int_param("5", "limit") == 5
    with pytest.raises(ApiError):
        httpio.int_param("five", "limit")


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        ("application/json;as=Table;v=v1;g=meta.k8s.io,application/json", "Table"),
        ("application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1", "PartialObjectMetadataList"),
        ("application/json", ""),
        ("", ""),
    ],
)
def test_the_output_format_a_client_asks_for(accept: str, expected: str) -> None:
    assert httpio.accept_as(request("GET", headers={"Accept": accept})) == expected


def test_json_answers_carry_warnings_as_headers() -> None:
    resp = httpio.json_response({"a": 1}, 201, ['unknown field "x"'])
    assert resp.status == 201 and resp.headers.getall("Warning") == ['299 - "unknown field \\"x\\""']
    encoder = httpio.ObjectEncoder(size=1)
    obj = {"metadata": {"uid": "u", "resourceVersion": "1"}}
    assert encoder.object_bytes(obj) == b'{"metadata":{"uid":"u","resourceVersion":"1"}}'
