"""HTTP health endpoints of the agent, for Kubernetes probes.

``GET /healthz`` answers 200 while the agent process is alive and its serving
thread runs (liveness). ``GET /readyz`` answers 200 while the agent's workers
are running and 503 otherwise, e.g. during rendezvous or after the workers
finished (readiness). Both bodies are small JSON documents. ``GET /metrics``
(when the server was given a ``metrics`` callable) answers the agent's metrics
in the Prometheus text format. Any other path is 404. The server runs on a
daemon thread and never blocks the agent.

The probes stay open to whoever reaches the port (the kubelet, Prometheus): they only read,
and say nothing secret (states and counters; never a key, a path to one, or checkpoint
bytes). What a stranger can do to them is bounded: at most :data:`MAX_CONNECTIONS` are
served at once (one more replaces the oldest, which is cut off and counted, service
``health``: a probe still gets through connections a stranger holds open), each may take
:data:`READ_TIMEOUT` seconds per read and :data:`CONNECTION_DEADLINE` seconds in all, and
one request is served per connection (HTTP/1.0).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kelastic.agent.auth import REFUSALS, Reason
from kelastic.agent.exposition import CONTENT_TYPE

__all__ = ["CONNECTION_DEADLINE", "MAX_CONNECTIONS", "READ_TIMEOUT", "SERVICE", "HealthServer"]

_log = logging.getLogger(__name__)

#: The health server's name in :data:`kelastic.agent.auth.REFUSALS` and ``/metrics``.
SERVICE = "health"
#: Connections served at once (probes and scrapes take one each, for milliseconds).
MAX_CONNECTIONS = 32
#: Seconds each read of a request may wait.
READ_TIMEOUT = 2.0
#: Seconds a connection may take in all (a client trickling its headers is cut off).
CONNECTION_DEADLINE = 5.0


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most :data:`MAX_CONNECTIONS` of them (a new one replaces
    the oldest), none older than :data:`CONNECTION_DEADLINE`."""

    daemon_threads = True
    # socketserver's default backlog of 5 drops the SYNs of a probe behind a burst of connections
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        #: connection -> when it was accepted (time.monotonic())
        self._active: dict[socket.socket, float] = {}

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            cut = []
            while len(self._active) >= MAX_CONNECTIONS:
                oldest = min(self._active, key=self._active.__getitem__)
                del self._active[oldest]
                cut.append(oldest)
            self._active[request] = time.monotonic()
        for old in cut:
            _cut(old, Reason.OVER_CAPACITY)
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        deadline = threading.Timer(CONNECTION_DEADLINE, self._expire, args=(request,))
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            with self._lock:
                self._active.pop(request, None)

    def _expire(self, request: socket.socket) -> None:
        with self._lock:
            held = self._active.pop(request, None) is not None
        if held:
            _cut(request, Reason.TIMEOUT)


def _cut(request: socket.socket, reason: Reason) -> None:
    REFUSALS.count(SERVICE, reason)
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _server_class(host: str) -> type[ThreadingHTTPServer]:
    """An HTTP server class of the address family of ``host`` (an IPv6 pod IP needs AF_INET6)."""
    if ":" not in host:
        return _BoundedServer

    class V6Server(_BoundedServer):
        address_family = socket.AF_INET6

    return V6Server


class HealthServer:
    """Serves ``/healthz`` and ``/readyz`` on ``host:port`` (``port=0`` picks a free port).

    ``is_ready`` is called on every ``/readyz`` request; ``detail`` (optional)
    returns extra JSON-serialisable fields for both bodies (e.g. the worker state);
    ``metrics`` (optional) returns the ``/metrics`` body in the Prometheus text format.
    Binding happens in the constructor, so an address in use fails at once with
    an ``OSError`` naming the port.
    """

    def __init__(
        self,
        port: int,
        is_ready: Callable[[], bool],
        *,
        host: str = "0.0.0.0",
        detail: Callable[[], dict[str, object]] | None = None,
        metrics: Callable[[], str] | None = None,
    ) -> None:
        self._is_ready = is_ready
        self._detail = detail or (lambda: {})
        self._metrics = metrics
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = READ_TIMEOUT

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    outer._reply(self, 200, {"status": "alive"})
                elif path == "/readyz":
                    try:
                        ready = bool(outer._is_ready())
                    except Exception as e:  # a broken callback means "not ready", not a crash
                        _log.warning("readiness check raised: %s", e)
                        ready = False
                    outer._reply(self, 200 if ready else 503, {"status": "ready" if ready else "not ready"})
                elif path == "/metrics" and outer._metrics is not None:
                    outer._reply_metrics(self)
                else:
                    known = "/healthz, /readyz" + (" or /metrics" if outer._metrics is not None else "")
                    outer._reply(self, 404, {"error": f"unknown path {path}; use {known}"})

            def log_message(self, format: str, *args: object) -> None:
                return None  # probes every few seconds would flood the agent's log

        try:
            self._server = _server_class(host)((host, port), Handler)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve health endpoints on {host}:{port}: {e.strerror}") from e
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    def _reply(self, handler: BaseHTTPRequestHandler, code: int, body: dict[str, object]) -> None:
        try:
            extra = self._detail()
        except Exception:
            extra = {}
        data = json.dumps({**body, **extra}).encode()
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _reply_metrics(self, handler: BaseHTTPRequestHandler) -> None:
        assert self._metrics is not None
        try:
            data, code = self._metrics().encode(), 200
        except Exception as e:  # a scrape must get an answer, never a dropped connection
            _log.warning("rendering /metrics failed: %s", e)
            data, code = f"rendering metrics failed: {e}\n".encode(), 500
        handler.send_response(code)
        handler.send_header("Content-Type", CONTENT_TYPE)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kelastic-health", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()
