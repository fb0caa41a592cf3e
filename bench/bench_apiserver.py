"""Benchmark of the kelastic local API server: write throughput, list, and watch fan-out.

Starts the API server as its own process (``python -m kelastic.localcluster.apiserver``),
then, from an asyncio HTTP client:

1. creates N pods (default 2,000) with C concurrent requests and prints requests/s;
2. lists them (one request, and paged with limit=500) and prints the time;
3. opens W watches (default 50) on a namespace, creates E pods, and prints how
   many events each watcher received and the event latency (create sent →
   event received) percentiles.

Prints figures only; asserts nothing about time. Usage::

    python bench/bench_apiserver.py [--pods 2000] [--concurrency 32] [--watchers 50] [--events 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

from kelastic.localcluster.testing import stop_process


def _pod(name: str, sent: float | None = None) -> dict:
    meta: dict = {"name": name, "labels": {"bench": "yes"}}
    if sent is not None:
        meta["annotations"] = {"bench/sent": repr(sent)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "main", "image": "python:3.11", "command": ["python", "-V"]}]},
    }


async def _create_many(session: aiohttp.ClientSession, base: str, ns: str, n: int, conc: int) -> float:
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        async with sem, session.post(f"{base}/api/v1/namespaces/{ns}/pods", json=_pod(f"p-{i:05d}")) as r:
            if r.status != 201:
                raise RuntimeError(f"create p-{i} failed: {r.status} {await r.text()}")
            await r.read()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0


async def _list(
    session: aiohttp.ClientSession, base: str, ns: str, limit: int | None
) -> tuple[int, float, int]:
    t0 = time.perf_counter()
    count = 0
    size = 0
    cont = ""
    while True:
        params = {"limit": str(limit)} if limit else {}
        if cont:
            params["continue"] = cont
        async with session.get(f"{base}/api/v1/namespaces/{ns}/pods", params=params) as r:
            body = await r.read()
        size += len(body)
        doc = json.loads(body)
        count += len(doc["items"])
        cont = doc["metadata"].get("continue", "")
        if not cont:
            break
    return count, time.perf_counter() - t0, size


async def _watch_fanout(base: str, ns: str, watchers: int, events: int) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{base}/api/v1/namespaces", json={"metadata": {"name": ns}}) as r:
            await r.read()
        async with session.get(f"{base}/api/v1/namespaces/{ns}/pods") as r:
            rv = (await r.json())["metadata"]["resourceVersion"]
        latencies: list[list[float]] = [[] for _ in range(watchers)]
        ready = 0
        all_ready = asyncio.Event()

        async def watch(i: int) -> None:
            nonlocal ready
            params = {"watch": "true", "resourceVersion": rv, "timeoutSeconds": "120"}
            async with session.get(f"{base}/api/v1/namespaces/{ns}/pods", params=params) as r:
                ready += 1
                if ready == watchers:
                    all_ready.set()
                async for line in r.content:
                    ev = json.loads(line)
                    sent = float(ev["object"]["metadata"]["annotations"]["bench/sent"])
                    latencies[i].append(time.time() - sent)
                    if len(latencies[i]) == events:
                        return

        tasks = [asyncio.create_task(watch(i)) for i in range(watchers)]
        await asyncio.wait_for(all_ready.wait(), 60)
        t0 = time.perf_counter()
        for j in range(events):
            async with session.post(
                f"{base}/api/v1/namespaces/{ns}/pods", json=_pod(f"w-{j:05d}", time.time())
            ) as r:
                await r.read()
        write_time = time.perf_counter() - t0
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        total = time.perf_counter() - t0
        flat = sorted(x for per in latencies for x in per)
        complete = sum(1 for per in latencies if len(per) == events)
        print(
            f"watch fan-out: {watchers} watchers x {events} events: {complete}/{watchers} watchers got every "
            f"event ({len(flat)} deliveries) in {total:.2f}s ({len(flat) / total:,.0f} deliveries/s; "
            f"writes took {write_time:.2f}s)"
        )
        print(
            f"event latency (create sent -> event received): p50 {statistics.median(flat) * 1e3:.1f} ms, "
            f"p99 {flat[int(len(flat) * 0.99) - 1] * 1e3:.1f} ms, max {flat[-1] * 1e3:.1f} ms"
        )


async def _run(base: str, args: argparse.Namespace) -> None:
    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        async with session.post(f"{base}/api/v1/namespaces", json={"metadata": {"name": "bench"}}) as r:
            await r.read()
        elapsed = await _create_many(session, base, "bench", args.pods, args.concurrency)
        rate = args.pods / elapsed
        print(
            f"create: {args.pods} pods in {elapsed:.2f}s = {rate:,.0f} requests/s (concurrency {args.concurrency})"
        )
        print(f"  at this rate the 800 pod creations of 100 ElasticJobs x 8 workers take {800 / rate:.1f}s")
        n, t, size = await _list(session, base, "bench", None)
        print(f"list: {n} pods in one request: {t * 1e3:.0f} ms ({size / 1e6:.1f} MB)")
        n, t, _ = await _list(session, base, "bench", 500)
        print(f"list: {n} pods in pages of 500: {t * 1e3:.0f} ms")
        t0 = time.perf_counter()
        for _ in range(200):
            async with session.get(f"{base}/api/v1/namespaces/bench/pods/p-00042") as r:
                await r.read()
        print(f"get: {200 / (time.perf_counter() - t0):,.0f} requests/s (sequential)")
    await _watch_fanout(base, "fanout", args.watchers, args.events)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--watchers", type=int, default=50)
    parser.add_argument("--events", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kelastic.localcluster.apiserver", "--port", "0", "--data-dir", data],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"the API server did not start: {line!r}")
            base = line.rsplit(" ", 1)[1].strip()
            print(f"API server at {base} (separate process)")
            asyncio.run(_run(base, args))
        finally:
            stop_process(proc, 10, kill_grace=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
