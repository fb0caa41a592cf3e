"""The emulator's answers that the conformance test found differing from kube-apiserver, pinned fast.

(``test_conformance.py`` compares both servers end to end; it needs the real
binaries and is slow. These run against the emulator alone.)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.localcluster.apiserver.kinds import validate_builtin
from kelastic.localcluster.apiserver.resources import TypeRegistry
from kelastic.localcluster.apiserver.ssa import applied_fields, conflict_message, conflicts, release
from kelastic.localcluster.apiserver.storage import EventType, Gone, Store


def _call(
    api: ApiServer, method: str, path: str, body: Any = None, ctype: str = "application/json"
) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{api.url}{path}", data=None if body is None else json.dumps(body).encode(), method=method
    )
    request.add_header("Content-Type", ctype)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_endpoints_refuse_loopback_link_local_and_multicast_addresses() -> None:
    endpoints = TypeRegistry().lookup("", "v1", "endpoints")
    assert endpoints is not None
    obj = {
        "metadata": {"name": "e"},
        "subsets": [
            {
                "addresses": [{"ip": "127.1.0.5"}, {"ip": "10.0.0.1"}],
                "notReadyAddresses": [{"ip": "169.254.1.1"}, {"ip": "not-an-ip"}],
            }
        ],
    }
    causes = {(c.field, c.message.split(": ", 1)[1]) for c in validate_builtin(endpoints, obj)}
    assert causes == {
        (
            "subsets[0].addresses[0].ip",
            '"127.1.0.5": may not be in the loopback range (127.0.0.0/8, ::1/128)',
        ),
        (
            "subsets[0].notReadyAddresses[0].ip",
            '"169.254.1.1": may not be in the link-local range (169.254.0.0/16, fe80::/10)',
        ),
        ("subsets[0].notReadyAddresses[1].ip", '"not-an-ip": must be a valid IP address'),
    }


def test_endpoints_with_a_loopback_address_are_422_over_http(api: ApiServer) -> None:
    code, body = _call(
        api,
        "POST",
        "/api/v1/namespaces/default/endpoints",
        {
            "metadata": {"name": "loop"},
            "subsets": [{"addresses": [{"ip": "127.0.0.1"}], "ports": [{"port": 80}]}],
        },
    )
    assert code == 422 and body["reason"] == "Invalid"
    assert body["details"] == {
        "name": "loop",
        "kind": "Endpoints",
        "causes": [
            {
                "reason": "FieldValueInvalid",
                "message": 'Invalid value: "127.0.0.1": may not be in the loopback range (127.0.0.0/8, ::1/128)',
                "field": "subsets[0].addresses[0].ip",
            }
        ],
    }  # no "group" for the core group, as the real API server answers


def test_server_side_apply_conflicts_name_the_owner_and_force_moves_ownership() -> None:
    alice = {"spec": {"size": 5, "color": "green"}}
    obj = {
        "metadata": {
            "managedFields": [
                {
                    "manager": "alice",
                    "operation": "Apply",
                    "fieldsV1": applied_fields(alice, merge_keys=False),
                }
            ]
        },
        "spec": {"size": 5, "color": "green"},
    }
    bob = {"spec": {"size": 6, "color": "green"}}
    clashes = conflicts(obj, "bob", applied_fields(bob, merge_keys=False), bob)
    # Same value: shared ownership, no conflict; a different value: a conflict.
    assert clashes == {'"alice"': [("f:spec", "f:size")]}
    message, causes = conflict_message(clashes)
    assert message == 'Apply failed with 1 conflict: conflict with "alice": .spec.size'
    assert causes == [('conflict with "alice"', ".spec.size")]
    assert conflicts(obj, "alice", applied_fields(bob, merge_keys=False), bob) == {}  # one's own fields
    (entry,) = release(obj["metadata"]["managedFields"], clashes)
    assert entry["fieldsV1"] == {"f:spec": {"f:color": {}}}


def test_server_side_apply_conflict_is_409_unless_forced(api: ApiServer) -> None:
    path = "/api/v1/namespaces/default/configmaps/ssa"
    apply = "application/apply-patch+yaml"
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"k": "alice"}}
    assert _call(api, "PATCH", path + "?fieldManager=alice", cm, apply)[0] == 201
    mine = {**cm, "data": {"k": "bob"}}
    code, body = _call(api, "PATCH", path + "?fieldManager=bob", mine, apply)
    assert code == 409 and body["reason"] == "Conflict"
    assert body["details"]["causes"] == [
        {"reason": "FieldManagerConflict", "message": 'conflict with "alice"', "field": ".data.k"}
    ]
    code, body = _call(api, "PATCH", path + "?fieldManager=bob&force=true", mine, apply)
    assert code == 200 and body["data"] == {"k": "bob"}
    owners = {m["manager"]: m.get("fieldsV1") for m in body["metadata"]["managedFields"]}
    # alice owned nothing else: her entry goes, as the real server drops empty ones.
    assert owners["bob"] == {"f:data": {"f:k": {}}} and "alice" not in owners


def test_a_custom_resources_history_starts_when_it_is_served() -> None:
    store = Store()
    for name in ("a", "b", "c"):
        store.put("/configmaps", {"metadata": {"name": name, "namespace": "default"}}, EventType.ADDED)
    store.open_history("g/widgets")
    start = store.rv
    store.put("g/widgets", {"metadata": {"name": "w", "namespace": "default"}}, EventType.ADDED)
    assert [e.key for e in store.events_since("g/widgets", start)] == ["g/widgets"]
    with pytest.raises(Gone, match=f"too old resource version: 1 \\({start}\\)"):
        list(store.events_since("g/widgets", 1))
    assert list(store.events_since("/configmaps", 0))  # built-ins: from the beginning
