"""A network partition that heals, with real agents in network namespaces.

Three ``kelastic-agent`` nodes, each in its own network namespace on a bridge
(veth pairs; the rendezvous store listens on the bridge's address), train a
small gloo job at 0.05 s per step. Node 3's link goes down, then up again:

* the survivors find it lost by its heartbeat and go on at world 2;
* the cut-off node's worker stays blocked in its all-reduce with the lost
  peers: it trains no step and writes nothing as a second group;
* when the link is back, node 3 re-joins and the group grows back to world 3,
  as in a scale-up; no step is trained twice by a group.

Needs root (``ip netns``); skipped otherwise. The stall of the running group at the
heal is printed, not asserted (``bench/bench_control_plane.py --faults partition``
prints it too).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kelastic.agent.rendezvous.server import ServerProcess, start_server_process

pytestmark = pytest.mark.slow

WORKER = """
import os, sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
out = Path(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
node = os.environ["KELASTIC_NODE_NAME"]
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
x = torch.ones(1)
step = 0
with open(out / f"steps_{node}.log", "a", buffering=1) as log:
    while not (out / "stop").exists():
        dist.all_reduce(x)
        log.write(f"{time.time():.6f} {world} {rank} {step} {os.environ['TORCHELASTIC_RESTART_COUNT']}\\n")
        step += 1
        time.sleep(0.05)
dist.barrier()
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Net:
    """A bridge with one namespace per node: ``hosts[i]`` is node i's address in ``spaces[i]``."""

    bridge: str
    gateway: str
    spaces: list[str]
    hosts: list[str]
    links: list[str]  # the bridge-side end of each node's veth pair

    def set_link(self, i: int, up: bool) -> None:
        _ip("link", "set", self.links[i], "up" if up else "down")


def _netns_usable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    return None


@contextlib.contextmanager
def make_net() -> Iterator[Net]:
    """A bridge and three namespaces, removed on exit; RuntimeError saying why if they cannot be made."""
    why = _netns_usable()
    if why:
        raise RuntimeError(why)
    tag = f"{os.getpid() % 10000}"
    subnet = f"10.{100 + os.getpid() % 100}.{os.getpid() % 250}"
    n = Net(
        f"kb{tag}", f"{subnet}.1", [f"kns{tag}-{i}" for i in range(3)], [], [f"kv{tag}-{i}" for i in range(3)]
    )
    try:
        _ip("link", "add", n.bridge, "type", "bridge")
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"cannot create a bridge: {exc.stderr.decode().strip()}") from None
    try:
        _ip("addr", "add", f"{n.gateway}/24", "dev", n.bridge)
        _ip("link", "set", n.bridge, "up")
        for i, space in enumerate(n.spaces):
            host = f"{subnet}.{i + 2}"
            _ip("netns", "add", space)
            _ip("link", "add", n.links[i], "type", "veth", "peer", "name", "eth0", "netns", space)
            _ip("link", "set", n.links[i], "master", n.bridge, "up")
            _ip("-n", space, "addr", "add", f"{host}/24", "dev", "eth0")
            _ip("-n", space, "link", "set", "eth0", "up")
            _ip("-n", space, "link", "set", "lo", "up")
            n.hosts.append(host)
        yield n
    finally:
        for space in n.spaces:
            subprocess.run(["ip", "netns", "del", space], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", n.bridge], capture_output=True, check=False)


@pytest.fixture
def net() -> Iterator[Net]:
    with contextlib.ExitStack() as stack:
        try:
            n = stack.enter_context(make_net())
        except RuntimeError as exc:
            pytest.skip(str(exc))
        yield n


def _steps(out: Path) -> list[tuple[float, int, int, int, str]]:
    """Every step of every node: (time, world, rank, step, node), in time order."""
    rows = []
    for path in out.glob("steps_*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                rows.append((float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), path.stem[6:]))
    return sorted(rows)


def _wait(what: str, cond: object, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.1)
    tails = "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


def run_partition(net: Net, tmp: Path, down: float) -> dict[str, float]:
    """Train, cut node 3 off for ``down`` s, heal; return the figures (see the module docstring)."""
    out = tmp / "out"
    out.mkdir()
    script = tmp / "worker.py"
    script.write_text(WORKER)
    server: ServerProcess = start_server_process(net.gateway, 29400, timeout=30)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp / f"node{i}.log" for i in range(3)]
    secret = tmp / "job-secret"  # the three nodes' agents share it (the bench runs this outside pytest)
    secret.write_text(secrets.token_hex(32))
    try:
        for i, space in enumerate(net.spaces):
            env = {
                **os.environ,
                "KELASTIC_NODE_NAME": f"node{i}",
                "PYTHONUNBUFFERED": "1",
                "LOGLEVEL": "INFO",
                # gloo would pick the interface the host name resolves to (loopback here)
                "GLOO_SOCKET_IFNAME": "eth0",
            }
            env.pop("OMP_NUM_THREADS", None)
            cmd = [
                "ip", "netns", "exec", space, sys.executable, "-m", "kelastic.agent",
                "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "3", "--warm-start",
                "--rdzv-backend", "kelastic", "--rdzv-endpoint", server.endpoint, "--rdzv-id", "partition",
                "--rdzv-conf", "last_call_timeout=30", "--local-addr", net.hosts[i],
                "--job-secret-file", str(secret),
                "--log-dir", str(tmp / "logs" / f"node{i}"), str(script), str(out),
            ]  # fmt: skip
            with logs[i].open("wb") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
        _wait("every node stepping at world 3", lambda: {r[4] for r in _steps(out) if r[1] == 3} == {"node0", "node1", "node2"}, 120, logs)  # fmt: skip
        time.sleep(1.0)
        cut = time.time()
        net.set_link(2, up=False)
        _wait(
            "the survivors at world 2", lambda: any(r[1] == 2 and r[0] > cut for r in _steps(out)), 60, logs
        )
        at_two = min(r[0] for r in _steps(out) if r[1] == 2 and r[0] > cut)
        time.sleep(max(0.0, cut + down - time.time()))
        healed = time.time()
        net.set_link(2, up=True)
        _wait(
            "the group back at world 3",
            lambda: any(r[1] == 3 and r[0] > healed for r in _steps(out)),
            90,
            logs,
        )
        time.sleep(2.0)
        (out / "stop").write_text("")
        for p, log in zip(procs, logs, strict=True):
            try:
                rc = p.wait(60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{log.name} did not finish:\n{log.read_text()[-3000:]}") from None
            assert rc == 0, f"{log.name} exited with {rc}:\n{log.read_text()[-3000:]}"
        rows = _steps(out)
        cut_off = [r for r in rows if r[4] == "node2" and cut + 1.0 < r[0] < healed]
        assert not cut_off, f"the cut-off node trained steps as a second group: {cut_off[:3]}"
        # After the heal, the longest time in which no rank completed a step.
        after = [r[0] for r in rows if r[0] > healed - 0.5]
        stall = max((b - a for a, b in itertools.pairwise(after)), default=0.0)
        first_three = min(r[0] for r in rows if r[1] == 3 and r[0] > healed)
        return {"detected": at_two - cut, "stall": stall, "back_at_three": first_three - healed}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        server.stop()


def test_a_healed_partition_costs_what_a_scale_up_costs(net: Net, tmp_path: Path) -> None:
    figures = run_partition(net, tmp_path, down=15.0)
    print(
        f"partition: survivors at world 2 after {figures['detected']:.2f}s; at the heal the running "
        f"group stalled {figures['stall']:.2f}s; world 3 again {figures['back_at_three']:.2f}s after it"
    )
