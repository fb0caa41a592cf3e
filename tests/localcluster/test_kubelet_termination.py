"""Termination messages: the process kubelet honours terminationMessagePath and -Policy."""

from __future__ import annotations

from typing import Any

from kelastic.localcluster.testing import Kubectl, cluster_fixture, kubectl_fixture, wait_for  # noqa: F401

_POD = """
apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: python:3.11
    command: [python, -c, {code!r}]
{extra}
"""

_WRITE = (
    "import os, sys\n"
    "open(os.environ['KELASTIC_TERMINATION_MESSAGE_PATH'], 'w').write('rank 0 exited with code 2: boom\\n')\n"
    "print('log line'); sys.exit(2)"
)
_LOG_ONLY = "import sys\nfor i in range(100): print('line', i)\nsys.exit(1)"


def _terminated(kubectl: Kubectl, name: str) -> dict[str, Any]:
    def ended() -> bool:
        cs = (kubectl.json("pod", name).get("status") or {}).get("containerStatuses") or [{}]
        return "terminated" in (cs[0].get("state") or {})

    wait_for(ended, 30, f"the container of pod {name} to terminate")
    return kubectl.json("pod", name)["status"]["containerStatuses"][0]["state"]["terminated"]


def test_termination_message_file_and_log_fallback(kubectl: Kubectl) -> None:
    kubectl.apply(_POD.format(name="writes", code=_WRITE, extra=""))
    kubectl.apply(
        _POD.format(
            name="fallback", code=_LOG_ONLY, extra="    terminationMessagePolicy: FallbackToLogsOnError"
        )
    )
    kubectl.apply(_POD.format(name="silent", code=_LOG_ONLY, extra=""))
    kubectl.apply(
        _POD.format(
            name="ok", code="print('fine')", extra="    terminationMessagePolicy: FallbackToLogsOnError"
        )
    )

    written = _terminated(kubectl, "writes")
    assert written["exitCode"] == 2
    assert written["message"] == "rank 0 exited with code 2: boom\n"

    fallback = _terminated(kubectl, "fallback")
    lines = fallback["message"].splitlines()
    assert len(lines) == 80 and lines[-1] == "line 99", fallback["message"]

    # policy File (the default) with an empty file: no message, even on failure
    assert "message" not in _terminated(kubectl, "silent")
    # success never falls back to the log
    assert "message" not in _terminated(kubectl, "ok")
    for name in ("writes", "fallback", "silent", "ok"):
        kubectl("delete", "pod", name, "--grace-period=0", "--force")
