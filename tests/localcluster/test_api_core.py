"""API server conformance: CRUD, errors, generation, list/watch, selectors, finalizers.

Driven by the official ``kubernetes`` client and the real kubectl against a real
ApiServer on loopback.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from kelastic.localcluster.apiserver.apiserver import ApiServer
from kelastic.localcluster.testing import Kubectl, wait_for


@pytest.fixture(scope="module")
def core(api: ApiServer) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(api.data_dir / "kubeconfig")))


@pytest.fixture(scope="module")
def kubectl(api: ApiServer) -> Kubectl:
    return Kubectl(api.data_dir / "kubeconfig")


def _pod(name: str, **labels: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "python:3.11", "command": ["python", "-V"]}]},
    }


def test_default_namespaces_and_discovery(kubectl: Kubectl) -> None:
    out = kubectl("get", "namespaces", "-o", "name")
    assert "namespace/default" in out and "namespace/kube-system" in out
    resources = kubectl("api-resources", "-o", "name")
    for name in (
        "pods",
        "services",
        "configmaps",
        "leases.coordination.k8s.io",
        "events.events.k8s.io",
        "customresourcedefinitions.apiextensions.k8s.io",
        "roles.rbac.authorization.k8s.io",
    ):
        assert name in resources.split(), name
    assert "v1.37" in kubectl("version", "-o", "json")


def test_create_get_conflicts_and_errors(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_pod("default", _pod("crud-a", app="a"))
    assert created.metadata.uid and created.metadata.creation_timestamp
    assert created.status.phase == "Pending"
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod("default", _pod("crud-a"))
    assert exc.value.status == 409 and "AlreadyExists" in exc.value.body
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod("missing", "default")
    assert exc.value.status == 404 and "NotFound" in exc.value.body
    generated = core.create_namespaced_pod("default", {**_pod(""), "metadata": {"generateName": "gen-"}})
    assert generated.metadata.name.startswith("gen-") and len(generated.metadata.name) == 9
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod("default", {**_pod("Bad_Name")})
    assert exc.value.status == 422 and "metadata.name" in exc.value.body
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod("nope", _pod("x"))
    assert exc.value.status == 404 and 'namespaces \\"nope\\" not found' in exc.value.body
    bad = _pod("noimage")
    del bad["spec"]["containers"][0]["image"]
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod("default", bad)
    assert exc.value.status == 422 and "spec.containers[0].image" in exc.value.body


def test_stale_update_conflicts_and_generation(core: client.CoreV1Api) -> None:
    cm = core.create_namespaced_config_map("default", {"metadata": {"name": "gen"}, "data": {"a": "1"}})
    assert cm.metadata.generation == 1
    stale_rv = cm.metadata.resource_version
    cm.data["a"] = "2"
    updated = core.replace_namespaced_config_map("gen", "default", cm)
    assert int(updated.metadata.resource_version) > int(stale_rv)
    cm.metadata.resource_version = stale_rv
    cm.data["a"] = "3"
    with pytest.raises(ApiException) as exc:
        core.replace_namespaced_config_map("gen", "default", cm)
    assert exc.value.status == 409 and "the object has been modified" in exc.value.body
    # Metadata-only changes keep the generation; status writes on pods too.
    labelled = core.patch_namespaced_config_map("gen", "default", {"metadata": {"labels": {"x": "y"}}})
    assert labelled.metadata.generation == updated.metadata.generation
    pod = core.create_namespaced_pod("default", _pod("gen-pod"))
    st = core.patch_namespaced_pod_status("gen-pod", "default", {"status": {"phase": "Running"}})
    assert st.status.phase == "Running" and st.metadata.generation == pod.metadata.generation
    # The main resource ignores status; the status subresource ignores spec.
    again = core.patch_namespaced_pod("gen-pod", "default", {"status": {"phase": "Failed"}})
    assert again.status.phase == "Running"


def test_list_watch_resume_and_gone(api: ApiServer, core: client.CoreV1Api) -> None:
    core.create_namespace({"metadata": {"name": "watched"}})
    start = core.list_namespaced_config_map("watched").metadata.resource_version
    for i in range(3):
        core.create_namespaced_config_map("watched", {"metadata": {"name": f"c{i}"}, "data": {"i": str(i)}})
    core.delete_namespaced_config_map("c1", "watched")
    w = watch.Watch()
    seen = []
    for ev in w.stream(core.list_namespaced_config_map, "watched", resource_version=start, timeout_seconds=5):
        seen.append((ev["type"], ev["object"].metadata.name))
        if len(seen) == 4:
            w.stop()
    assert seen == [("ADDED", "c0"), ("ADDED", "c1"), ("ADDED", "c2"), ("DELETED", "c1")]
    # Paging with limit/continue returns everything once.
    names = []
    cont = None
    while True:
        page = core.list_namespaced_config_map("watched", limit=1, _continue=cont)
        names += [c.metadata.name for c in page.items]
        cont = page.metadata._continue
        if not cont:
            break
    assert names == ["c0", "c2"] or names == sorted(names)
    api.compact()
    with pytest.raises(ApiException) as exc:
        for _ in watch.Watch().stream(
            core.list_namespaced_config_map, "watched", resource_version=start, timeout_seconds=5
        ):
            pass
    assert exc.value.status == 410


def test_watch_sees_live_events_and_bookmarks(api: ApiServer, core: client.CoreV1Api) -> None:
    core.create_namespace({"metadata": {"name": "live"}})
    rv = core.list_namespaced_pod("live").metadata.resource_version
    events: list[tuple[str, str]] = []

    def consume() -> None:
        w = watch.Watch()
        for ev in w.stream(
            core.list_namespaced_pod,
            "live",
            resource_version=rv,
            timeout_seconds=10,
            label_selector="app=web",
        ):
            events.append((ev["type"], ev["object"].metadata.name))
            if len(events) == 3:
                w.stop()

    t = threading.Thread(target=consume)
    t.start()
    core.create_namespaced_pod("live", _pod("w1", app="web"))
    core.create_namespaced_pod("live", _pod("other", app="db"))
    # Relabelling out of the selector reaches the watcher as DELETED.
    core.patch_namespaced_pod("w1", "live", {"metadata": {"labels": {"app": "gone"}}})
    core.create_namespaced_pod("live", _pod("w2", app="web"))
    t.join(15)
    assert events == [("ADDED", "w1"), ("DELETED", "w1"), ("ADDED", "w2")]


def test_label_and_field_selectors(core: client.CoreV1Api, kubectl: Kubectl) -> None:
    core.create_namespace({"metadata": {"name": "sel"}})
    for name, tier, env in [("p1", "web", "prod"), ("p2", "web", "dev"), ("p3", "db", "prod")]:
        core.create_namespaced_pod("sel", _pod(name, tier=tier, env=env))
    core.patch_namespaced_pod_status("p3", "sel", {"status": {"phase": "Running"}})

    def names(**kw: str) -> list[str]:
        return [p.metadata.name for p in core.list_namespaced_pod("sel", **kw).items]

    assert names(label_selector="tier=web") == ["p1", "p2"]
    assert names(label_selector="tier=web,env!=dev") == ["p1"]
    assert names(label_selector="env in (prod),tier notin (web)") == ["p3"]
    assert names(label_selector="!missing,tier") == ["p1", "p2", "p3"]
    assert names(field_selector="status.phase=Running") == ["p3"]
    assert names(field_selector="metadata.name!=p1,status.phase=Pending") == ["p2"]
    out = kubectl("get", "pods", "-n", "sel", "-l", "env=prod", "-o", "name")
    assert out.split() == ["pod/p1", "pod/p3"]
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_pod("sel", field_selector="spec.bogus=1")
    assert exc.value.status == 400


def test_finalizers_hold_deletion(core: client.CoreV1Api) -> None:
    core.create_namespaced_config_map(
        "default", {"metadata": {"name": "held", "finalizers": ["example.com/hold"]}}
    )
    core.delete_namespaced_config_map("held", "default")
    held = core.read_namespaced_config_map("held", "default")
    assert held.metadata.deletion_timestamp is not None
    core.patch_namespaced_config_map("held", "default", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_config_map("held", "default")
    assert exc.value.status == 404


def test_graceful_pod_deletion(core: client.CoreV1Api, kubectl: Kubectl) -> None:
    core.create_namespaced_pod("default", {**_pod("grace"), "spec": {**_pod("x")["spec"], "nodeName": "n1"}})
    core.delete_namespaced_pod("grace", "default")
    pod = core.read_namespaced_pod("grace", "default")
    assert pod.metadata.deletion_timestamp and pod.metadata.deletion_grace_period_seconds == 30
    kubectl("delete", "pod", "grace", "--grace-period=0", "--force", "--wait=false")
    wait_for(
        lambda: "grace" not in [p.metadata.name for p in core.list_namespaced_pod("default").items],
        5,
        "the force-deleted pod to disappear",
    )


def test_kubectl_table_and_logs_errors(core: client.CoreV1Api, kubectl: Kubectl, api: ApiServer) -> None:
    core.create_namespaced_pod("default", _pod("tbl"))
    out = kubectl("get", "pod", "tbl")
    assert out.split("\n")[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert out.split("\n")[1].split()[:4] == ["tbl", "0/1", "Pending", "0"]
    pod = core.read_namespaced_pod("tbl", "default")
    log_dir = Path(api.data_dir) / "pods" / f"default_tbl_{pod.metadata.uid}" / "main"
    log_dir.mkdir(parents=True)
    (log_dir / "0.log").write_text("first\nsecond\n")
    assert kubectl("logs", "tbl") == "first\nsecond\n"
    assert kubectl("logs", "tbl", "--tail=1") == "second\n"


def test_watch_bookmarks_and_initial_events(tmp_path: Path) -> None:
    import json
    import urllib.request

    def until_bookmark(url: str) -> list[dict]:
        """The watch's events up to its first BOOKMARK (the watch is left then, not waited out)."""
        events = []
        with urllib.request.urlopen(url, timeout=10) as resp:
            for line in resp:
                events.append(json.loads(line))
                if events[-1]["type"] == "BOOKMARK":
                    break
        return events

    server = ApiServer(data_dir=tmp_path, bookmark_interval=0.3)
    server.start()
    try:
        events = until_bookmark(f"{server.url}/api/v1/namespaces?watch=true&allowWatchBookmarks=true")
        kinds = [e["type"] for e in events]
        assert kinds[:4] == ["ADDED"] * 4 and "BOOKMARK" in kinds
        bookmark = next(e for e in events if e["type"] == "BOOKMARK")["object"]
        assert bookmark["kind"] == "Namespace" and int(bookmark["metadata"]["resourceVersion"]) > 0
        url = (
            f"{server.url}/api/v1/namespaces?watch=true&sendInitialEvents=true&allowWatchBookmarks=true"
            "&resourceVersionMatch=NotOlderThan&resourceVersion="
        )
        events = until_bookmark(url)
        end = next(i for i, e in enumerate(events) if e["type"] == "BOOKMARK")
        assert end == 4
        assert events[end]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    finally:
        server.stop()


def test_events_are_shared_between_core_and_events_api(api: ApiServer, core: client.CoreV1Api) -> None:
    events = client.EventsV1Api(config.new_client_from_config(str(api.data_dir / "kubeconfig")))
    created = events.create_namespaced_event(
        "default",
        {
            "metadata": {"name": "ev-new"},
            # Non-zero micro-seconds: the client writes a datetime without them as
            # "...T00:00:00+00:00", which a MicroTime refuses (on a real server too).
            "eventTime": "2026-01-01T00:00:00.123456Z",
            "reportingController": "kelastic.io/test",
            "reportingInstance": "test-1",
            "action": "Testing",
            "reason": "Tested",
            "type": "Normal",
            "note": "posted through events.k8s.io",
            "regarding": {"kind": "Pod", "name": "p", "namespace": "default"},
        },
    )
    assert created.note == "posted through events.k8s.io"
    as_core = core.read_namespaced_event("ev-new", "default")
    assert as_core.message == "posted through events.k8s.io" and as_core.involved_object.name == "p"
    core.create_namespaced_event(
        "default",
        {
            "metadata": {"name": "ev-core"},
            "involvedObject": {"kind": "Pod", "name": "p"},
            "reason": "Old",
            "message": "posted through core/v1",
            "type": "Warning",
        },
    )
    names = {e.metadata.name: e.note for e in events.list_namespaced_event("default").items}
    assert names["ev-core"] == "posted through core/v1"
    assert [
        e.metadata.name
        for e in core.list_namespaced_event(
            "default", field_selector="involvedObject.name=p,reason=Old"
        ).items
    ] == ["ev-core"]


def test_kubectl_create_generators_send_protobuf(kubectl: Kubectl, core: client.CoreV1Api) -> None:
    kubectl("create", "namespace", "gen-ns")
    kubectl("create", "configmap", "gen-cm", "-n", "gen-ns", "--from-literal=a=b")
    kubectl("create", "secret", "generic", "gen-s", "-n", "gen-ns", "--from-literal=k=v")
    kubectl("create", "serviceaccount", "gen-sa", "-n", "gen-ns")
    kubectl("create", "service", "clusterip", "gen-svc", "-n", "gen-ns", "--tcp=80:8080")
    kubectl("create", "role", "gen-role", "-n", "gen-ns", "--verb=get", "--resource=pods")
    assert core.read_namespace("gen-ns").status.phase == "Active"
    assert core.read_namespaced_config_map("gen-cm", "gen-ns").data == {"a": "b"}
    assert core.read_namespaced_secret("gen-s", "gen-ns").data == {"k": "dg=="}
    svc = core.read_namespaced_service("gen-svc", "gen-ns")
    assert svc.spec.cluster_ip.startswith("127.2.") and svc.spec.ports[0].target_port == 8080
    assert svc.spec.selector == {"app": "gen-svc"}
    assert kubectl("auth", "can-i", "create", "pods").strip() == "yes"
    kubectl(
        "create", "deployment", "gen-dep", "-n", "gen-ns", "--image=python:3.11", "--replicas=2", "--port=80"
    )
    kubectl("create", "job", "gen-job", "-n", "gen-ns", "--image=python:3.11", "--", "python", "-V")
    dep = kubectl.json("deployment", "gen-dep", "-n", "gen-ns")
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["selector"] == {"matchLabels": {"app": "gen-dep"}}
    assert "creationTimestamp" not in dep["spec"]["template"]["metadata"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "python:3.11" and container["ports"] == [
        {"containerPort": 80, "protocol": "TCP"}
    ]
    job = kubectl.json("job", "gen-job", "-n", "gen-ns")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["python", "-V"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_unknown_fields_of_builtin_kinds(kubectl: Kubectl, core: client.CoreV1Api) -> None:
    import json
    import subprocess

    typo = _pod("typo")
    typo["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    proc = subprocess.run(
        [kubectl.exe, "--kubeconfig", str(kubectl.kubeconfig), "apply", "-f", "-"],
        input=json.dumps(typo),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode != 0
    assert 'unknown field "spec.containers[0].imagePullPolicyy"' in proc.stderr
    # Without strict validation the field is dropped with a warning, as a typed API server does.
    import urllib.request

    url = core.api_client.configuration.host + "/api/v1/namespaces/default/pods"
    req = urllib.request.Request(
        url, data=json.dumps(typo).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        created = json.loads(resp.read())
        assert 'unknown field \\"spec.containers[0].imagePullPolicyy\\"' in resp.headers["Warning"]
    assert "imagePullPolicyy" not in json.dumps(created)


def test_binding_and_immutable_fields(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", _pod("bindme"))
    core.create_namespaced_pod_binding(
        "bindme",
        "default",
        {"metadata": {"name": "bindme"}, "target": {"kind": "Node", "name": "node-1"}},
        _preload_content=False,
    )
    pod = core.read_namespaced_pod("bindme", "default")
    assert pod.spec.node_name == "node-1"
    assert [c.type for c in pod.status.conditions] == ["PodScheduled"]
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod_binding(
            "bindme",
            "default",
            {"metadata": {"name": "bindme"}, "target": {"kind": "Node", "name": "node-2"}},
            _preload_content=False,
        )
    assert exc.value.status == 409
    # A pod's spec is immutable apart from images and a few fields.
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("bindme", "default", {"spec": {"restartPolicy": "Never"}})
    assert exc.value.status == 422 and "pod updates may not change fields" in exc.value.body
    patched = core.patch_namespaced_pod(
        "bindme", "default", {"spec": {"containers": [{"name": "main", "image": "python:3.12"}]}}
    )
    assert patched.spec.containers[0].image == "python:3.12"
    core.create_namespaced_config_map(
        "default", {"metadata": {"name": "frozen"}, "data": {"a": "1"}, "immutable": True}
    )
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_config_map("frozen", "default", {"data": {"a": "2"}})
    assert exc.value.status == 422
    with pytest.raises(ApiException) as exc:
        core.delete_namespace("default")
    assert exc.value.status == 403
