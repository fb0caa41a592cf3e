"""A failed probe is said in the real kubelet's words (its Unhealthy event quotes them).

The texts are those of Kubernetes v1.37's prober (pkg/probe/http, tcp and exec, and Go's
net package for a refused connection): ``HTTP probe failed with statuscode: 503``,
``Get "http://H:P/path": dial tcp H:P: connect: connection refused``, an exec probe's own
output, ``command timed out``.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import socket
import threading
from pathlib import Path

from kelastic.localcluster.kubelet.probes import ProbeKind, ProbeResult, ProbeSpec, probe_once


class _NotReady(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = 200 if self.path == "/ok" else 503
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def probe(tmp_path: Path, kind: ProbeKind, handler: dict, timeout: float = 2.0) -> tuple[ProbeResult, str]:
    spec = ProbeSpec(kind=kind, handler=handler, timeout=timeout)
    return asyncio.run(probe_once(spec, pod_ip="127.0.0.1", env=dict(os.environ), cwd=str(tmp_path)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_http_and_tcp_failures_read_as_the_real_kubelets(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotReady)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert probe(tmp_path, ProbeKind.HTTP_GET, {"path": "/ok", "port": port}) == (ProbeResult.SUCCESS, "")
        assert probe(tmp_path, ProbeKind.HTTP_GET, {"path": "/readyz", "port": port}) == (
            ProbeResult.FAILURE,
            "HTTP probe failed with statuscode: 503",
        )
    finally:
        server.shutdown()
        server.server_close()
    closed = free_port()
    assert probe(tmp_path, ProbeKind.HTTP_GET, {"path": "/readyz", "port": closed}) == (
        ProbeResult.FAILURE,
        f'Get "http://127.0.0.1:{closed}/readyz": dial tcp 127.0.0.1:{closed}: connect: connection refused',
    )
    assert probe(tmp_path, ProbeKind.TCP_SOCKET, {"port": closed}) == (
        ProbeResult.FAILURE,
        f"dial tcp 127.0.0.1:{closed}: connect: connection refused",
    )


def test_an_exec_probe_says_its_own_output_or_that_it_timed_out(tmp_path: Path) -> None:
    script = "import sys; print('not yet'); sys.exit(1)"
    assert probe(tmp_path, ProbeKind.EXEC, {"command": ["python", "-c", script]}) == (
        ProbeResult.FAILURE,
        "not yet\n",
    )
    loud = "import sys; sys.stdout.write('x' * 100000)"
    result, output = probe(tmp_path, ProbeKind.EXEC, {"command": ["python", "-c", loud]})
    assert (result, len(output)) == (ProbeResult.SUCCESS, 10 * 1024)  # kept as the kubelet keeps it
    assert probe(tmp_path, ProbeKind.EXEC, {"command": ["sleep", "30"]}, timeout=0.3) == (
        ProbeResult.FAILURE,
        "command timed out",
    )
