"""crds/elasticjob.yaml's cross-field rules (x-kubernetes-validations), on both API servers, with the real kubectl.

A spec the operator would refuse for a cross-field reason (maxReplicas below minReplicas,
replicas outside them, the gang's minAvailable above maxReplicas, standbys without kelastic's
rendezvous, an etcd backend without its endpoint, the operator's own rdzvConf key) is refused
by the API server itself: ``kubectl apply`` and ``kubectl scale`` fail, in the operator's own
words. A job written before the rules keeps its status, metadata and other spec writes (a
rule holds back only a change to the fields it reads), and the operator still judges it
(tests/operator/test_op_spec.py). The real kube-apiserver's answers are the expected ones;
the emulator must give the same, to the character. Run on v1.37.2 and, with
``KELASTIC_CONTROL_PLANE`` naming a ``K8S_VERSION=v1.30.14 K8S_COMPONENTS=kube-apiserver``
build, on the oldest supported release.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from kelastic.operator.spec import parse_job

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "elasticjob.yaml"

pytestmark = pytest.mark.slow


if TYPE_CHECKING:
    from kelastic.localcluster.testing import KubectlApi as Server


@pytest.fixture(scope="module")
def server(kubectl_api: Server) -> Server:
    return kubectl_api


def said(server: Server, *args: str, stdin: str | None = None) -> tuple[int, str]:
    """kubectl's answer; an older release (1.30) writes a rule's object value as ``"object"``
    (``Invalid value: "object": ...``), which is all that differs there."""
    code, text = server.said(*args, stdin=stdin)
    return code, text.replace('Invalid value: "object": ', "Invalid value: ")


def apply_crd(server: Server, crd: dict[str, Any]) -> None:
    server.ok("apply", "-f", "-", stdin=yaml.safe_dump(crd))


def the_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())  # type: ignore[no-any-return]


def without_rules(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD as it was before it had rules."""
    out = copy.deepcopy(crd)
    del out["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"
    ]
    return out


def job(name: str, *, replicas: int = 2, **spec: Any) -> dict[str, Any]:
    container = {"name": "trainer", "image": "torch:1", "command": ["python", "train.py"]}
    worker = {"replicas": replicas, "template": {"spec": {"containers": [container]}}}
    return {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"minReplicas": 1, "maxReplicas": 4, "replicaSpecs": {"Worker": worker}, **spec},
    }


def wait_served(server: Server, refused: bool) -> None:
    """Until the ElasticJob kind is served, with (``refused``) or without its rules in force."""
    probe = yaml.safe_dump(job("probe", minReplicas=5))
    deadline = time.monotonic() + 60
    while True:
        done = server.kubectl("apply", "--dry-run=server", "-f", "-", stdin=probe)
        if done.returncode != 0 and "must be at least" in done.stderr and refused:
            return
        if done.returncode == 0 and not refused:
            return
        assert time.monotonic() < deadline, f"the CRD was not in force within 60 s: {done.stderr}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def crd(server: Server) -> Server:
    apply_crd(server, the_crd())
    wait_served(server, refused=True)
    return server


def invalid(name: str, *lines: str) -> str:
    if len(lines) == 1:
        return f'The ElasticJob "{name}" is invalid: {lines[0]}'
    return f'The ElasticJob "{name}" is invalid: \n' + "\n".join(f"* {line}" for line in lines)


STANDBY = (
    "needs spec.rdzvBackend kelastic (got c10d): standbys wait in kelastic's rendezvous without a rank; "
    "set standbyReplicas to 0 or use the kelastic backend"
)
ETCD = (
    "is required with rdzvBackend etcd: HOST:PORT of your etcd (the operator runs a rendezvous store only "
    "for the kelastic and c10d backends)"
)
#: A spec breaking one rule, the field named, and the operator's words for it.
BROKEN = [
    (
        {"minReplicas": 5, "replicas": 5},
        "spec.maxReplicas",
        "(4) must be at least spec.minReplicas (5); raise maxReplicas or lower minReplicas",
    ),
    ({"replicas": 6}, "spec.replicaSpecs.Worker.replicas", "(6) must be within [spec.minReplicas, spec.maxReplicas] = [1, 4]"),
    (
        {"minReplicas": 3, "replicas": 2},
        "spec.replicaSpecs.Worker.replicas",
        "(2) must be within [spec.minReplicas, spec.maxReplicas] = [3, 4]",
    ),
    ({"schedulingPolicy": {"minAvailable": 5}}, "spec.schedulingPolicy.minAvailable", "must be at most spec.maxReplicas=4, got 5"),
    ({"standbyReplicas": 1, "rdzvBackend": "c10d"}, "spec.standbyReplicas", STANDBY),
    ({"rdzvBackend": "etcd"}, "spec.rdzvEndpoint", ETCD),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "field", "words"), BROKEN, ids=[b[1] + ":" + b[2][:20] for b in BROKEN])
def test_apply_refuses_a_spec_that_breaks_a_rule_in_the_operators_words(
    crd: Server, spec: dict[str, Any], field: str, words: str
) -> None:
    bad = job("bad", **spec)
    assert said(crd, "apply", "-f", "-", stdin=yaml.safe_dump(bad)) == (
        1,
        invalid("bad", f"{field}: Invalid value: {words}"),
    )
    assert crd.kubectl("get", "ej", "bad").returncode != 0
    # The operator's own check (for jobs written before the rules) says the same.
    error = parse_job(bad).error
    assert error is not None and (error.field, error.message) == (field, words)


def test_the_operators_rdzv_conf_key_and_two_broken_rules_at_once(crd: Server) -> None:
    bad = job("conf", rdzvConf={"controlled": "true"})
    assert said(crd, "apply", "-f", "-", stdin=yaml.safe_dump(bad)) == (
        1,
        invalid(
            "conf",
            "spec.rdzvConf: Invalid value: controlled is set by the operator: the agents of a kelastic-backend "
            "job always wait for the membership it publishes; remove the key",
        ),
    )
    # Replicas outside a range that is itself wrong: only the range is named.
    two = job("two", minReplicas=5, replicas=6, rdzvBackend="etcd")
    assert said(crd, "apply", "-f", "-", stdin=yaml.safe_dump(two)) == (
        1,
        invalid(
            "two",
            "spec.maxReplicas: Invalid value: (4) must be at least spec.minReplicas (5); raise maxReplicas or "
            "lower minReplicas",
            f"spec.rdzvEndpoint: Invalid value: {ETCD}",
        ),
    )


def test_kubectl_scale_outside_the_range_is_refused_with_the_same_words(crd: Server) -> None:
    assert said(crd, "apply", "-f", "-", stdin=yaml.safe_dump(job("scaled")))[0] == 0
    above = said(crd, "scale", "ej", "scaled", "--replicas", "6")
    assert above == (
        1,
        invalid(
            "scaled",
            "spec.replicaSpecs.Worker.replicas: Invalid value: (6) must be within [spec.minReplicas, "
            "spec.maxReplicas] = [1, 4]",
        ),
    )
    assert said(crd, "scale", "ej", "scaled", "--replicas", "0")[0] == 1
    assert said(crd, "scale", "ej", "scaled", "--replicas", "4") == (
        0,
        "elasticjob.kelastic.dev/scaled scaled",
    )
    stored = json.loads(crd.kubectl("get", "ej", "scaled", "-o", "json").stdout)
    assert stored["spec"]["replicaSpecs"]["Worker"]["replicas"] == 4


def test_a_job_written_before_the_rules_keeps_its_status_and_metadata_writes(server: Server) -> None:
    """Written while the CRD had no rules: a rule holds back only a change to the fields it
    reads (here minReplicas and maxReplicas), so status, labels, a new image or a scale pass."""
    crd = the_crd()
    apply_crd(server, without_rules(crd))
    wait_served(server, refused=False)
    try:
        old = yaml.safe_dump(job("old", minReplicas=5, replicas=6))
        assert said(server, "apply", "-f", "-", stdin=old) == (0, "elasticjob.kelastic.dev/old created")
    finally:
        apply_crd(server, crd)
        wait_served(server, refused=True)
    status = json.dumps({"status": {"phase": "Failed"}})
    assert said(server, "patch", "ej", "old", "--subresource=status", "--type=merge", "-p", status) == (
        0,
        "elasticjob.kelastic.dev/old patched",
    )
    assert said(server, "label", "ej", "old", "team=a") == (0, "elasticjob.kelastic.dev/old labeled")
    image = json.dumps([{"op": "replace", "path": "/spec/replicaSpecs/Worker/template/spec/containers/0/image",
                         "value": "torch:2"}])  # fmt: skip
    assert said(server, "patch", "ej", "old", "--type=json", "-p", image) == (
        0,
        "elasticjob.kelastic.dev/old patched",
    )
    assert said(server, "scale", "ej", "old", "--replicas", "4") == (0, "elasticjob.kelastic.dev/old scaled")
    still = json.dumps({"spec": {"maxReplicas": 3}})
    assert said(server, "patch", "ej", "old", "--type=merge", "-p", still) == (
        1,
        invalid(
            "old",
            "spec.maxReplicas: Invalid value: (3) must be at least spec.minReplicas (5); raise maxReplicas or "
            "lower minReplicas",
        ),
    )
    mend = json.dumps({"spec": {"maxReplicas": 6, "replicaSpecs": {"Worker": {"replicas": 5}}}})
    assert said(server, "patch", "ej", "old", "--type=merge", "-p", mend) == (
        0,
        "elasticjob.kelastic.dev/old patched",
    )
