"""Benchmark: how fast kelastic-operator brings up many ElasticJobs, and what it costs.

Applies N ElasticJobs of P worker pods each (one ``kubectl apply``) to a local
API server with the operator running as a subprocess, and prints:

- the time until every pod exists (P workers + 1 rendezvous store per job) and
  until every job has a status;
- the operator's CPU time (user+system, from /proc) for that burst, per job, and
  its peak memory (VmHWM); the CPU of this process meanwhile (the in-process API
  server, plus this benchmark's own polls), to tell which side is the bottleneck;
- the API requests the operator sent (its own client and kopf's, told apart from
  this benchmark's by User-Agent, counted by the in-process API server), per job,
  during the burst and while idle afterwards;
- its CPU per job per minute while idle afterwards.

By default only the API server runs (no kubelet), so pods are created but not
started: this measures the operator, not the processes (N x P agents importing
torch would swamp a laptop). ``--kubelet`` runs the whole LocalCluster instead
and also waits until every pod is Running; use it with small N.

    python bench/bench_operator.py                       # 100 jobs x 4 pods
    python bench/bench_operator.py --jobs 1000 --pods 8  # the scale figures
    python bench/bench_operator.py --jobs 1 --pods 1000  # one large job
    python bench/bench_operator.py --jobs 10 --pods 2 --kubelet
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from kelastic.localcluster.testing import stop_process

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "elasticjob.yaml"
LABEL = "kelastic.dev/job-name"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its reaped children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory of a process (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def own_cpu_seconds() -> float:
    """User + system CPU of this process, all threads (the in-process API server's share)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


#: User-Agent prefixes of the operator's requests: its own client, and kopf's (list, watch).
OPERATOR_AGENTS = ("kelastic-operator", "kopf")


class RequestCounter:
    """Counts the operator's requests at the in-process API server, by verb and resource."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def install(self) -> None:
        """Wrap the API server's request handler (before it starts serving)."""
        from kelastic.localcluster.apiserver import apiserver

        original = apiserver._App.handle
        counter = self

        async def counting(app: Any, request: Any) -> Any:
            if request.headers.get("User-Agent", "").startswith(OPERATOR_AGENTS):
                method = "POST(dry run)" if "dryRun" in request.query else request.method
                counter.add(method, request.path, "watch" in request.query)
            return await original(app, request)

        apiserver._App.handle = counting  # type: ignore[method-assign]

    def add(self, method: str, path: str, watch: bool) -> None:
        parts = [p for p in path.split("/") if p]
        # /api/v1/namespaces/NS/pods/NAME/log -> pods/log; /apis/G/V/namespaces/NS/PLURAL -> PLURAL
        if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
            rest = parts[parts.index("namespaces") + 2 :]
        else:
            rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
        resource = "/".join(rest[:1] + rest[2:3]) or path
        verb = "WATCH" if watch else method
        with self._lock:
            self.counts[(verb, resource)] += 1

    def snapshot(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self.counts)


def kubectl(kubeconfig: Path, *args: str, input: str | None = None) -> str:
    proc = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def wait(what: str, cond: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


def job(name: str, pods: int, agent: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "kelastic.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": pods,
            "replicaSpecs": {
                "Worker": {
                    "replicas": pods,
                    "template": {
                        "spec": {
                            "containers": [
                                {"name": "trainer", "image": "kelastic:dev", "command": ["python", "noop.py"]}
                            ]
                        }
                    },
                }
            },
        },
    }
    if agent:
        body["spec"]["agent"] = agent
    return body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--pods", type=int, default=4, help="worker pods per job")
    ap.add_argument("--idle", type=float, default=15.0, help="seconds of idle CPU measurement afterwards")
    ap.add_argument("--kubelet", action="store_true", help="run the whole LocalCluster (pods really start)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument(
        "--worker-seconds",
        type=float,
        default=0.0,
        help="with --kubelet: how long each worker stays up (the idle figure then covers running jobs)",
    )
    ap.add_argument(
        "--operator-path",
        type=Path,
        help="run the operator from this directory first on its PYTHONPATH (one holding kelastic/operator and "
        "kelastic/agent of another revision, e.g. from `git archive REV operator agent`): before/after figures",
    )
    ap.add_argument(
        "--agent",
        choices=("inject", "image"),
        help="the jobs' spec.agent (default: the CRD's, inject); `image` makes pods without the agent's "
        "init container, as revisions before agent injection did",
    )
    args = ap.parse_args()

    from kelastic.operator.kube import Kube, load_configuration

    requests = RequestCounter()
    requests.install()
    tmp = Path(tempfile.mkdtemp(prefix="kelastic-bench-operator-"))
    kubeconfig = tmp / "kubeconfig"
    # The trivial training script (--kubelet runs it): one progress report, then idle.
    (tmp / "noop.py").write_text(
        "import time\nfrom kelastic.agent.progress import update\nupdate(1, 1)\n"
        f"time.sleep({args.worker_seconds})\n"
    )
    if args.kubelet:
        from kelastic.localcluster.cli.cluster import LocalCluster

        cluster: Any = LocalCluster(tmp / "data", kubeconfig=kubeconfig, workdir=tmp)
        cluster.start()
    else:
        from kelastic.localcluster.apiserver.apiserver import ApiServer

        cluster = ApiServer(data_dir=tmp / "data")
        cluster.start()
        cluster.write_kubeconfig(kubeconfig)
    operator: subprocess.Popen[bytes] | None = None
    try:
        kubectl(kubeconfig, "apply", "-f", str(CRD))
        kube = Kube(load_configuration(str(kubeconfig)))
        kube._api.user_agent = "kelastic-bench"  # not counted as the operator's

        def pods(selector: str | None = None) -> list[dict[str, Any]]:
            query = {"labelSelector": selector or LABEL}
            return kube.request("GET", "/api/v1/namespaces/default/pods", query=query)["items"]

        def pod_count() -> int:
            """How many pods of ours exist, without listing them (limit=1 and remainingItemCount)."""
            answer = kube.request(
                "GET", "/api/v1/namespaces/default/pods", query={"labelSelector": LABEL, "limit": "1"}
            )
            return len(answer["items"]) + int((answer.get("metadata") or {}).get("remainingItemCount") or 0)

        def jobs() -> list[dict[str, Any]]:
            return kube.request("GET", Kube.job_path("default"))["items"]

        log = tmp / "operator.log"
        # Health endpoints are off: all local pods share one network namespace.
        cmd = [sys.executable, "-m", "kelastic.operator", "--kubeconfig", str(kubeconfig), "--standalone",
               "--log-level", "warning", "--health-port", "0",
               # No kubelet: pods never run. Jobs must not fail for lack of running workers
               # while thousands of pods are still being created.
               "--min-replicas-timeout", "86400"]  # fmt: skip
        env = dict(os.environ)
        if args.operator_path:
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(args.operator_path), env.get("PYTHONPATH")])
            )
        operator = subprocess.Popen(
            cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

        # Warm up (imports, watches, caches) with one job, then remove it.
        kubectl(kubeconfig, "apply", "-f", "-", input=yaml.safe_dump(job("warmup", 1, args.agent)))
        wait("the warm-up job's pods", lambda: len(pods(f"{LABEL}=warmup")) == 2, 120)
        kubectl(kubeconfig, "delete", "ej", "warmup", "--wait=false")
        wait("the warm-up pods to go", lambda: not pods(f"{LABEL}=warmup"), 60)
        time.sleep(1.0)

        expected = args.jobs * (args.pods + 1)
        manifest = yaml.safe_dump_all(
            [job(f"bench-{i:04d}", args.pods, args.agent) for i in range(args.jobs)]
        )
        cpu0 = cpu_seconds(operator.pid)
        server_cpu0 = own_cpu_seconds()
        requests0 = requests.snapshot()
        t0 = time.monotonic()
        kubectl(kubeconfig, "apply", "-f", "-", input=manifest)
        t_applied = time.monotonic() - t0
        first_seen: dict[str, float] = {}

        # Listing thousands of pods 20 times a second (in this process, beside the API server)
        # would load the server more than the operator does: up to 1,000 pods they are listed
        # at every poll (first-seen times to 50 ms); beyond, only counted, and a job's last pod
        # is dated by its creationTimestamp (to the second) in one listing at the end.
        fine = expected <= 1000
        wall0 = time.time()

        def all_pods() -> bool:
            now = time.monotonic() - t0
            if not fine:
                return pod_count() >= expected
            items = pods()
            for p in items:
                first_seen.setdefault(p["metadata"]["name"], now)
            return len(items) >= expected

        wait(f"{expected} pods", all_pods, args.timeout, every=0.05 if fine else 0.2)
        if not fine:
            for p in pods():
                created = datetime.fromisoformat(p["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
                first_seen[p["metadata"]["name"]] = max(0.0, created.timestamp() + 1 - wall0)
        t_pods = time.monotonic() - t0
        wait(
            "a status on every job",
            lambda: all((j.get("status") or {}).get("phase") for j in jobs()),
            args.timeout,
        )
        t_status = time.monotonic() - t0
        t_running = None
        if args.kubelet:
            wait(
                "every pod Running",
                lambda: (
                    sum(1 for p in pods() if (p.get("status") or {}).get("phase") in ("Running", "Succeeded"))
                    >= expected
                ),
                args.timeout,
                every=0.5,
            )
            t_running = time.monotonic() - t0
        cpu_burst = cpu_seconds(operator.pid) - cpu0
        server_cpu = own_cpu_seconds() - server_cpu0
        burst_requests = requests.snapshot() - requests0
        cpu1 = cpu_seconds(operator.pid)
        requests1 = requests.snapshot()
        time.sleep(args.idle)
        cpu_idle = cpu_seconds(operator.pid) - cpu1
        idle_requests = requests.snapshot() - requests1
        rss = peak_rss_mib(operator.pid)

        last_pod: dict[str, float] = {}
        for name, seen in first_seen.items():
            job_name = name.split("-")[1]  # bench-012-worker-3, bench-012-rendezvous
            last_pod[job_name] = max(last_pod.get(job_name, 0.0), seen)
        per_job_ready = sorted(last_pod.values())
        print(
            f"kelastic-operator: {args.jobs} ElasticJobs x {args.pods} workers (+1 store pod each) = {expected} pods"
            + (f" (operator from {args.operator_path})" if args.operator_path else "")
        )
        print(
            f"  mode                        : {'LocalCluster (kubelet runs pods)' if args.kubelet else 'API server only (pods not started)'}"
        )
        print(f"  kubectl apply of the jobs   : {t_applied:.2f} s")
        print(f"  all pods exist              : {t_pods:.2f} s after apply ({expected / t_pods:.0f} pods/s)")
        print(f"  a job's last pod exists     : median {statistics.median(per_job_ready):.2f} s, p90 "
              f"{per_job_ready[int(0.9 * (len(per_job_ready) - 1))]:.2f} s")  # fmt: skip
        print(f"  every job has a status      : {t_status:.2f} s")
        if t_running is not None:
            print(f"  every pod Running           : {t_running:.2f} s")
        print(
            f"  operator CPU for the burst  : {cpu_burst:.2f} s = {1000 * cpu_burst / args.jobs:.1f} ms per job"
        )
        print(
            f"  API server CPU, burst       : {server_cpu:.2f} s (the in-process API server and this benchmark's polls)"
        )
        print(f"  operator CPU while idle     : {cpu_idle:.2f} s over {args.idle:.0f} s = "
              f"{1000 * cpu_idle / args.jobs * 60 / args.idle:.1f} ms per job per minute")  # fmt: skip
        print(f"  operator peak memory (RSS)  : {rss:.0f} MiB")
        n_burst, n_idle = sum(burst_requests.values()), sum(idle_requests.values())
        print(f"  API requests, burst         : {n_burst} = {n_burst / args.jobs:.1f} per job "
              f"({', '.join(f'{v} {r} {n}' for (v, r), n in burst_requests.most_common(6))})")  # fmt: skip
        print(f"  API requests while idle     : {n_idle} over {args.idle:.0f} s = "
              f"{n_idle / args.jobs * 60 / args.idle:.2f} per job per minute"
              + (f" ({', '.join(f'{v} {r} {n}' for (v, r), n in idle_requests.most_common(4))})" if n_idle else ""))  # fmt: skip
        print(json.dumps({"jobs": args.jobs, "pods_per_job": args.pods, "all_pods_s": round(t_pods, 3),
                          "status_s": round(t_status, 3), "cpu_per_job_ms": round(1000 * cpu_burst / args.jobs, 2),
                          "server_cpu_s": round(server_cpu, 2),
                          "idle_cpu_per_job_per_min_ms": round(1000 * cpu_idle / args.jobs * 60 / args.idle, 2),
                          "peak_rss_mib": round(rss, 1), "requests_per_job": round(n_burst / args.jobs, 2),
                          "idle_requests_per_job_per_min": round(n_idle / args.jobs * 60 / args.idle, 3)}))  # fmt: skip
        kube.close()
        return 0
    finally:
        if operator is not None:
            stop_process(operator, 15, kill_grace=5, group=True)
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
