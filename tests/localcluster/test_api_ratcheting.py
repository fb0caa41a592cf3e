"""CEL rules on an update: ratcheting, ``optionalOldSelf`` and ``format``, on both API servers.

A rule added to a CRD after its objects were written does not lock them: an update that
leaves the rule's node as it was passes, with a warning naming the broken rule (the real
server's ratcheting). What the server cannot see as unchanged (a map under
``x-kubernetes-preserve-unknown-fields``, which its ratcheting never finds equal) is judged
again. A rule with ``optionalOldSelf`` runs on create too, with ``oldSelf`` empty (its
message sees ``oldSelf`` as it is, not as an optional: the rule's text stands in for a message
that calls ``hasValue()``). The real
kube-apiserver's answers are the expected ones; the emulator gives the same, to the character.
"""

from __future__ import annotations

import copy
import json
import time
from typing import TYPE_CHECKING, Any

import pytest

pytestmark = pytest.mark.slow

GROUP = "ratchet.kelastic.dev"
RULES = [
    {"rule": "self.low <= self.high"},
    {
        "rule": "oldSelf.hasValue() && oldSelf.value().size == self.size || self.size < 10",
        "optionalOldSelf": True,
        "fieldPath": ".size",
        "messageExpression": '"%d is too big (was %s)".format([self.size, oldSelf.hasValue() ? "set" : "new"])',
    },
]
CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"boxes.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "boxes", "singular": "box", "kind": "Box"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "low": {"type": "integer"},
                                    "high": {"type": "integer"},
                                    "size": {"type": "integer", "default": 1},
                                    "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


if TYPE_CHECKING:
    from kelastic.localcluster.testing import KubectlApi as Server


@pytest.fixture(scope="module")
def server(kubectl_api: Server) -> Server:
    return kubectl_api


def crd(rules: list[dict[str, Any]] | None) -> str:
    out = copy.deepcopy(CRD)
    if rules:
        spec = out["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        spec["x-kubernetes-validations"] = rules
    return json.dumps(out)


def box(name: str, **spec: Any) -> str:
    return json.dumps({"apiVersion": f"{GROUP}/v1", "kind": "Box", "metadata": {"name": name}, "spec": spec})


def settle(server: Server, probe: str, refused: bool) -> None:
    """Until the CRD's rules are (``refused``) or are not in force for a create of ``probe``."""
    deadline = time.monotonic() + 60
    while True:
        code, said = server.said("apply", "-n", "default", "--dry-run=server", "-f", "-", stdin=probe)
        if (code != 0 and "Invalid value" in said) == refused and (code == 0 or refused):
            return
        assert time.monotonic() < deadline, f"the CRD did not settle within 60 s: {said}"
        time.sleep(0.5)


def test_rules_added_later_ratchet_what_an_update_left_as_it_was(server: Server) -> None:
    assert server.said("apply", "-f", "-", stdin=crd(None))[0] == 0
    settle(server, box("probe", low=5, high=4), refused=False)
    assert server.said("apply", "-n", "default", "-f", "-", stdin=box("plain", low=5, high=4))[0] == 0
    free = box("free", low=5, high=4, free={"any": "thing"})
    assert server.said("apply", "-n", "default", "-f", "-", stdin=free)[0] == 0
    assert server.said("apply", "-f", "-", stdin=crd(RULES))[0] == 0
    settle(server, box("probe", low=5, high=4), refused=True)
    warned = "Warning: spec: Invalid value: failed rule: self.low <= self.high"
    assert server.said("label", "-n", "default", "box", "plain", "x=1") == (
        0,
        f"box.{GROUP}/plain labeled\n{warned}",
    )
    status = json.dumps({"status": {"seen": True}})
    assert server.said(
        "patch", "-n", "default", "box", "plain", "--subresource=status", "--type=merge", "-p", status
    ) == (0, f"box.{GROUP}/plain patched\n{warned}")
    refused = 'The Box "free" is invalid: spec: Invalid value: failed rule: self.low <= self.high'
    assert server.said("label", "-n", "default", "box", "free", "x=1") == (1, refused)
    grow = json.dumps({"spec": {"size": 12}})
    assert server.said("patch", "-n", "default", "box", "plain", "--type=merge", "-p", grow) == (
        1,
        'The Box "plain" is invalid: \n'
        "* spec: Invalid value: failed rule: self.low <= self.high\n"
        "* spec.size: Invalid value: failed rule: oldSelf.hasValue() && oldSelf.value().size == self.size "
        "|| self.size < 10",
    )
    assert server.said("apply", "-n", "default", "-f", "-", stdin=box("big", low=1, high=2, size=11)) == (
        1,
        'The Box "big" is invalid: spec.size: Invalid value: failed rule: oldSelf.hasValue() && '
        "oldSelf.value().size == self.size || self.size < 10",
    )
