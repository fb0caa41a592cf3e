"""Benchmark of the process kubelet and the service proxy of ``kelastic local``.

Prints:
- pod turnaround: N pods created at once through the API, time from each
  create to its ``Running``/``Succeeded`` as seen on a watch (p50/p95/max) and
  pods/s overall, for a no-op binary (kubelet overhead) and for ``python -c pass``
  (what a Python container costs);
- service proxy throughput: bytes streamed to a pod directly (pod IP) and
  through its ClusterIP, and the ratio.

    python bench/bench_local_kubelet.py [--pods 40] [--megabytes 64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kelastic.localcluster import LocalCluster


def _request(url: str, method: str = "GET", body: Any = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"{}")


def _pod(name: str, command: list[str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "x", "command": command}],
        },
    }


def _watch_phases(url: str, seen: dict[str, dict[str, float]], stop: threading.Event) -> None:
    with urllib.request.urlopen(f"{url}/api/v1/namespaces/default/pods?watch=true", timeout=300) as resp:
        for line in resp:
            if stop.is_set():
                return
            obj = json.loads(line)["object"]
            phase = (obj.get("status") or {}).get("phase")
            if phase:
                seen.setdefault(obj["metadata"]["name"], {}).setdefault(phase, time.monotonic())


def bench_pods(cluster: LocalCluster, label: str, command: list[str], count: int) -> None:
    seen: dict[str, dict[str, float]] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_phases, args=(cluster.url, seen, stop), daemon=True)
    watcher.start()
    time.sleep(0.3)
    created: dict[str, float] = {}
    start = time.monotonic()
    for i in range(count):
        name = f"{label}-{i}"
        created[name] = time.monotonic()
        _request(f"{cluster.url}/api/v1/namespaces/default/pods", "POST", _pod(name, command))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all("Succeeded" in seen.get(n, {}) or "Failed" in seen.get(n, {}) for n in created):
            break
        time.sleep(0.05)
    else:
        late = {n: sorted(seen.get(n, {})) for n in created if "Succeeded" not in seen.get(n, {})}
        raise SystemExit(f"{label}: {len(late)} pods did not finish within 120 s; phases seen: {late}")
    total = max(seen[n].get("Succeeded", seen[n].get("Failed", 0.0)) for n in created) - start
    stop.set()
    for phase in ("Running", "Succeeded"):
        lat = sorted(seen[n][phase] - created[n] for n in created if phase in seen[n])
        if lat:
            p95 = lat[min(len(lat) - 1, int(len(lat) * 0.95))]
            print(
                f"{label:>12}: create→{phase:<9} p50 {statistics.median(lat) * 1000:7.0f} ms  "
                f"p95 {p95 * 1000:7.0f} ms  max {lat[-1] * 1000:7.0f} ms  ({len(lat)} pods)"
            )
    print(f"{label:>12}: {count} pods finished in {total:.2f} s = {count / total:.1f} pods/s")
    for name in created:
        _request(f"{cluster.url}/api/v1/namespaces/default/pods/{name}?gracePeriodSeconds=0", "DELETE")


SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], 9000))
while True:
    conn, _ = srv.accept()
    total = 0
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        total += len(data)
    conn.sendall(str(total).encode())
    conn.close()
"""


def _send(host: str, port: int, megabytes: int) -> float:
    chunk = b"x" * (1 << 20)
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=30) as sock:
        for _ in range(megabytes):
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
        received = int(sock.recv(64) or b"0")
    elapsed = time.monotonic() - start
    if received != megabytes << 20:
        raise SystemExit(f"the sink received {received} bytes instead of {megabytes << 20}")
    return megabytes / elapsed


def bench_proxy(cluster: LocalCluster, megabytes: int) -> None:
    url = f"{cluster.url}/api/v1/namespaces/default"
    pod = _pod("sink", [sys.executable, "-c", SINK, "$(POD_IP)"], labels={"app": "sink"})
    pod["spec"]["containers"][0]["env"] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    ]
    pod["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": 9000}, "periodSeconds": 1}
    _request(f"{url}/pods", "POST", pod)
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "sink"},
        "spec": {"selector": {"app": "sink"}, "ports": [{"port": 8080, "targetPort": 9000}]},
    }
    cluster_ip = _request(f"{url}/services", "POST", svc)["spec"]["clusterIP"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        subsets = (
            _request(f"{url}/endpoints/sink").get("subsets") if _exists(f"{url}/endpoints/sink") else None
        )
        if subsets and subsets[0].get("addresses"):
            break
        time.sleep(0.1)
    else:
        raise SystemExit("the sink pod never became a ready endpoint")
    pod_ip = _request(f"{url}/pods/sink")["status"]["podIP"]
    direct = max(_send(pod_ip, 9000, megabytes) for _ in range(2))
    proxied = max(_send(cluster_ip, 8080, megabytes) for _ in range(2))
    print(f"       proxy: {megabytes} MiB direct to the pod IP {direct:7.0f} MiB/s")
    print(
        f"       proxy: {megabytes} MiB through the ClusterIP {proxied:7.0f} MiB/s  (ratio {proxied / direct:.2f})"
    )


def _exists(url: str) -> bool:
    try:
        _request(url)
        return True
    except urllib.error.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pods", type=int, default=40)
    parser.add_argument("--megabytes", type=int, default=64)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="kelastic-bench-kubelet-"))
    try:
        with LocalCluster(data) as cluster:
            bench_pods(cluster, "true", ["true"], args.pods)
            bench_pods(cluster, "python-pass", ["python", "-c", "pass"], args.pods)
            bench_proxy(cluster, args.megabytes)
    finally:
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
