"""LIST: selectors, pages and the resourceVersion a list is read at.

:func:`list_objects` is the registry's LIST: label and field selectors, pages of
``limit`` items chained by continue tokens (each token names the last item and the
resourceVersion of the first page, so every page reads the same list), and the
``resourceVersion``/``resourceVersionMatch`` parameters with the real server's answers
(400 for a malformed one, 410 Gone for an exact version that is not the current one,
504 for one from the future). The parts are pure functions.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

from .errors import ApiError
from .registry_types import ListResult, Obj
from .resources import ResourceType
from .selectors import make_predicate, parse_field_selector, parse_label_selector
from .storage import Store

__all__ = ["check_resource_version", "decode_continue", "list_objects", "page"]


def check_resource_version(resource_version: str | None, match: str | None, current: int) -> None:
    """Refuse a list's ``resourceVersion``/``resourceVersionMatch`` the way the real server does."""
    if match and match not in ("NotOlderThan", "Exact"):
        raise ApiError.bad_request(
            f'resourceVersionMatch: Unsupported value: {match!r}: supported values: "Exact", "NotOlderThan"'
        )
    if match and not resource_version:
        raise ApiError.bad_request("resourceVersionMatch is forbidden unless resourceVersion is provided")
    if not resource_version or resource_version == "0":
        return
    try:
        wanted = int(resource_version)
    except ValueError:
        raise ApiError.bad_request(f"invalid resourceVersion {resource_version!r}") from None
    if match == "Exact" and wanted != current:
        raise ApiError.gone(
            f"too old resource version: {wanted} ({current}); only the current version can be listed exactly"
        )
    if wanted > current:
        raise ApiError(
            504,
            "Timeout",
            f"Too large resource version: {wanted}, current: {current}",
            {
                "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                "retryAfterSeconds": 1,
            },
        )


def decode_continue(token: str) -> tuple[tuple[str, str], str]:
    """((namespace, name) of the last item listed, the list's resourceVersion) of a continue token."""
    try:
        tok = json.loads(base64.urlsafe_b64decode(token.encode()))
        return (tok["ns"], tok["name"]), str(tok["rv"])
    except (ValueError, KeyError, TypeError):
        raise ApiError.bad_request(f"invalid continue token {token!r}") from None


def page(items: list[Obj], limit: int | None, list_rv: str) -> ListResult:
    """The first ``limit`` of ``items`` (all without a positive limit) and the token of the rest."""
    if not limit or limit <= 0 or len(items) <= limit:
        return ListResult(items, list_rv, "", None)
    last = items[limit - 1]["metadata"]
    cont = base64.urlsafe_b64encode(
        json.dumps({"ns": last.get("namespace", ""), "name": last["name"], "rv": list_rv}).encode()
    ).decode()
    return ListResult(items[:limit], list_rv, cont, len(items) - limit)


def list_objects(
    store: Store,
    rt: ResourceType,
    namespace: str | None,
    present: Callable[[ResourceType, Obj], Obj],
    *,
    label_selector: str | None = None,
    field_selector: str | None = None,
    limit: int | None = None,
    continue_token: str | None = None,
    resource_version: str | None = None,
    resource_version_match: str | None = None,
) -> ListResult:
    """LIST ``rt`` objects (all namespaces when ``namespace`` is None), filtered by label
    and field selectors, in pages of ``limit`` with ``continue_token``, each item as
    ``present`` serves it; 410 Gone for a continue token or resourceVersion older than the
    retained history."""
    ns = namespace if rt.namespaced and namespace else None
    pred = make_predicate(
        ns, parse_label_selector(label_selector), parse_field_selector(field_selector, rt.kind)
    )
    check_resource_version(resource_version, resource_version_match, store.rv)
    list_rv = str(store.rv)
    objs = store.list(rt.key, ns)
    if continue_token:
        start_after, list_rv = decode_continue(continue_token)
        objs = [o for o in objs if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > start_after]
    return page([present(rt, o) for o in objs if pred(o)], limit, list_rv)
