"""Unit tests of the registry's parts, each a pure decision: admission, listing, patching,
deletion and a new object's metadata. The registry as a whole is tested through HTTP
(test_api_core.py, test_api_crd.py, test_fidelity.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kelastic.localcluster.apiserver import admission, deletion, listing, objectmeta, patching
from kelastic.localcluster.apiserver.errors import ApiError
from kelastic.localcluster.apiserver.registry_types import DeleteOptions, PatchType
from kelastic.localcluster.apiserver.resources import BUILTINS, TypeRegistry, types_from_crd
from kelastic.localcluster.apiserver.storage import EventType, Store

PODS = next(t for t in BUILTINS if t.kind == "Pod")
NAMESPACES = next(t for t in BUILTINS if t.kind == "Namespace")
WIDGET_CRD = {
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "scope": "Namespaced",
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {}}}],
    },
}
WIDGETS = types_from_crd(WIDGET_CRD)[0]


def pod(name: str, ns: str = "default", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}", **meta}, "spec": {}}


def code_of(call: Any, *args: Any) -> int:
    with pytest.raises(ApiError) as caught:
        call(*args)
    return caught.value.code


# -- admission -------------------------------------------------------------------------------
def test_a_pods_priority_comes_from_its_class_or_the_default_one() -> None:
    store, types = Store(), TypeRegistry()
    classes = types.lookup("scheduling.k8s.io", "v1", "priorityclasses")
    assert classes is not None
    store.put(classes.key, {"metadata": {"name": "high"}, "value": 1000}, EventType.ADDED)
    named = {"spec": {"priorityClassName": "high"}}
    admission.admit_priority(store, types, named, "p")
    assert named["spec"] == {
        "priorityClassName": "high",
        "priority": 1000,
        "preemptionPolicy": "PreemptLowerPriority",
    }
    plain: dict[str, Any] = {"spec": {}}
    admission.admit_priority(store, types, plain, "p")
    assert plain["spec"] == {}  # no global default: priority 0 by omission
    store.put(
        classes.key, {"metadata": {"name": "usual"}, "value": 5, "globalDefault": True}, EventType.ADDED
    )
    admission.admit_priority(store, types, plain, "p")
    assert (plain["spec"]["priorityClassName"], plain["spec"]["priority"]) == ("usual", 5)
    assert (
        code_of(admission.admit_priority, store, types, {"spec": {"priorityClassName": "nope"}}, "p") == 403
    )


def test_pod_security_refuses_what_the_namespace_enforces_and_warns_of_the_rest() -> None:
    store = Store()
    labels = {
        "pod-security.kubernetes.io/enforce": "baseline",
        "pod-security.kubernetes.io/warn": "restricted",
    }
    store.put("/namespaces", {"metadata": {"name": "guarded", "labels": labels}}, EventType.ADDED)
    privileged = {"spec": {"containers": [{"name": "c", "securityContext": {"privileged": True}}]}}
    assert code_of(admission.pod_security, store, PODS, privileged, "guarded", "p") == 403
    plain = {"spec": {"containers": [{"name": "c"}]}}
    warnings = admission.pod_security(store, PODS, plain, "guarded", "p")
    assert len(warnings) == 1 and "restricted" in warnings[0], warnings
    assert admission.pod_security(store, WIDGETS, plain, "guarded", "w") == []


def test_a_crd_may_not_take_a_built_in_resources_name() -> None:
    crd = {
        "metadata": {"name": "pods."},
        "spec": {"group": "", "versions": [{"name": "v1"}], "names": {"plural": "pods"}},
    }
    assert code_of(admission.check_crd_names, TypeRegistry(), crd) == 422
    admission.check_crd_names(TypeRegistry(), WIDGET_CRD)


# -- listing ---------------------------------------------------------------------------------
def test_pages_chain_by_continue_tokens_at_the_first_pages_version() -> None:
    store = Store()
    for name in ("a", "b", "c"):
        store.put(PODS.key, pod(name), EventType.ADDED)
    first = listing.list_objects(store, PODS, "default", lambda rt, o: o, limit=2)
    assert [o["metadata"]["name"] for o in first.items] == ["a", "b"]
    assert (first.remaining, first.resource_version) == (1, "3")
    store.put(PODS.key, pod("d"), EventType.ADDED)
    rest = listing.list_objects(store, PODS, "default", lambda rt, o: o, continue_token=first.continue_token)
    assert [o["metadata"]["name"] for o in rest.items] == ["c", "d"]
    assert (rest.resource_version, rest.continue_token) == ("3", "")
    assert code_of(listing.decode_continue, "not-a-token") == 400


@pytest.mark.parametrize(
    ("rv", "match", "code"),
    [("x", None, 400), ("5", "Exact", 410), ("99", None, 504), (None, "Exact", 400), ("1", "Any", 400)],
)
def test_a_lists_resource_version_is_refused_as_the_real_server_does(
    rv: str | None, match: str | None, code: int
) -> None:
    assert code_of(listing.check_resource_version, rv, match, 10) == code


def test_a_lists_resource_version_that_is_fine() -> None:
    for rv, match in ((None, None), ("0", None), ("10", "Exact"), ("3", "NotOlderThan")):
        listing.check_resource_version(rv, match, 10)


# -- patching --------------------------------------------------------------------------------
def test_patch_formats_and_their_refusals() -> None:
    current = pod("p", labels={"a": "1"})
    merged = patching.patched(PODS, current, PatchType.MERGE, {"metadata": {"labels": {"a": None, "b": "2"}}})
    assert merged["metadata"]["labels"] == {"b": "2"} and current["metadata"]["labels"] == {"a": "1"}
    assert code_of(patching.patched, WIDGETS, {}, PatchType.STRATEGIC, {}) == 415
    assert (
        code_of(patching.patched, PODS, current, PatchType.JSON, [{"op": "remove", "path": "/nope"}]) == 422
    )
    assert code_of(patching.patched, PODS, current, PatchType.MERGE, [1]) == 400
    assert (
        code_of(patching.patched, PODS, current, PatchType.JSON, [{"op": "replace", "path": "", "value": 1}])
        == 400
    )


def test_server_side_apply_conflicts_unless_forced() -> None:
    assert code_of(patching.apply_fields, PODS, {}, None) == 422
    assert code_of(patching.apply_fields, PODS, [1], "me") == 400
    config = {"metadata": {"name": "p", "labels": {"a": "1"}}}
    fields = patching.apply_fields(PODS, config, "first")
    first = patching.applied(PODS, pod("p"), pod("p"), config, "first", fields, False)
    assert first["metadata"]["labels"] == {"a": "1"}
    assert [m["manager"] for m in first["metadata"]["managedFields"]] == ["first"]
    other = {"metadata": {"name": "p", "labels": {"a": "2"}}}
    other_fields = patching.apply_fields(PODS, other, "second")
    with pytest.raises(ApiError) as caught:
        patching.applied(PODS, first, first, other, "second", other_fields, False)
    assert caught.value.code == 409 and "first" in caught.value.message
    taken = patching.applied(PODS, first, first, other, "second", other_fields, True)
    assert taken["metadata"]["labels"] == {"a": "2"}


# -- deletion --------------------------------------------------------------------------------
def test_delete_preconditions() -> None:
    meta = {"name": "p", "uid": "u1", "resourceVersion": "7"}
    deletion.check_preconditions(PODS, meta, DeleteOptions(precondition_uid="u1", precondition_rv="7"))
    assert code_of(deletion.check_preconditions, PODS, meta, DeleteOptions(precondition_uid="u2")) == 409
    assert code_of(deletion.check_preconditions, PODS, meta, DeleteOptions(precondition_rv="6")) == 409


def test_the_propagation_policy_adds_the_collectors_finalizer_only_for_dependents() -> None:
    meta = {"finalizers": ["mine"]}
    assert deletion.finalizers_for("Orphan", meta, lambda: True) == ["mine", deletion.FINALIZER_ORPHAN]
    assert deletion.finalizers_for("Foreground", meta, lambda: True) == [
        "mine",
        deletion.FINALIZER_FOREGROUND,
    ]
    assert deletion.finalizers_for("Orphan", meta, lambda: False) == ["mine"]
    assert deletion.finalizers_for("Background", meta, lambda: True) == ["mine"]
    assert code_of(deletion.finalizers_for, "Sometimes", meta, lambda: False) == 400


def test_deleting_again_only_shortens_a_pods_grace_or_adds_a_finalizer() -> None:
    marked = deletion.marked(pod("p"), 30, [])
    assert marked["metadata"]["deletionGracePeriodSeconds"] == 30 and "finalizers" not in marked["metadata"]
    assert deletion.deleted_again(marked, True, 30, []) == (None, False)
    shorter, goes = deletion.deleted_again(marked, True, 5, [])
    assert shorter is not None and shorter["metadata"]["deletionGracePeriodSeconds"] == 5 and not goes
    assert deletion.deleted_again(marked, True, 0, [])[1] is True
    held = deletion.marked(pod("p"), 0, ["keep"])
    assert deletion.deleted_again(held, True, 0, ["keep"]) == (None, False)
    added, goes = deletion.deleted_again(held, False, 0, ["keep", "orphan"])
    assert added is not None and added["metadata"]["finalizers"] == ["keep", "orphan"] and not goes


# -- a new object's metadata -----------------------------------------------------------------
def test_a_generated_name_avoids_taken_ones() -> None:
    meta: dict[str, Any] = {"generateName": "worker-"}
    name = objectmeta.name_of(PODS, meta, lambda n: False)
    assert name.startswith("worker-") and len(name) == len("worker-") + 5 and meta["name"] == name
    assert code_of(objectmeta.name_of, PODS, {"generateName": "w-"}, lambda n: True) == 500
    assert code_of(objectmeta.name_of, PODS, {}, lambda n: False) == 422
    assert code_of(objectmeta.name_of, PODS, {"name": "Not_A_Name"}, lambda n: False) == 422


def test_the_server_sets_a_new_objects_metadata() -> None:
    meta: dict[str, Any] = {"name": "p", "namespace": "x", "resourceVersion": "9", "uid": "mine"}
    objectmeta.set_new_metadata(PODS, meta, "default", None)
    assert meta["namespace"] == "default" and "resourceVersion" not in meta and meta["uid"] != "mine"
    assert meta["generation"] == 1 and meta["creationTimestamp"].endswith("Z")
    cluster_wide: dict[str, Any] = {"name": "n", "namespace": "x"}
    objectmeta.set_new_metadata(NAMESPACES, cluster_wide, "", [{"manager": "m"}])
    assert "namespace" not in cluster_wide and cluster_wide["managedFields"] == [{"manager": "m"}]


@pytest.mark.parametrize(
    "body",
    [[], {"kind": "Service"}, {"apiVersion": "v2"}, {"metadata": []}, {"metadata": {"namespace": "other"}}],
)
def test_a_body_that_is_not_the_urls_object_is_refused(body: Any) -> None:
    assert code_of(objectmeta.check_body, PODS, body, "default") == 400
