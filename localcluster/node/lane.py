"""``RealNodeLane``: N real Kubernetes nodes on this machine, beside a real control plane.

Each node is the upstream kubelet on its own containerd (runc, the CNI bridge), with
kube-router as its NetworkPolicy firewall and kube-proxy in nftables mode, all inside the
node's network namespace and cgroup (:mod:`.plan` has the layout, :mod:`.network` the
wiring, :mod:`.configs` the files). Use::

    lane = RealNodeLane(NodeBinaries.find(node_dir), nodes=2, logs_dir=...)
    lane.prepare()                      # slot, janitor, bridge, namespaces, cgroups
    cp = ControlPlane(..., **lane.control_plane_settings())
    cp.start()
    lane.start(cp)                      # containerd, images, kubelets Ready, kube-router, kube-proxy
    ...
    lane.stop_components()              # the kubelets, kube-routers, kube-proxies, containerds
    cp.stop()
    lane.stop()                         # everything removed (also when this process is killed)

The control plane stops in between: kube-apiserver waits on SIGTERM for the components'
watches to end, and it removes itself from the ``kubernetes`` Service through its address on
the lane's bridge, which ``stop()`` removes; either way it would be killed after its grace.

:meth:`RealNodeLane.prepare` starts the janitor (:mod:`.janitor`) before it makes anything,
so whatever happens next, SIGKILL included, the host is left as it was found.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..controlplane.controlplane import ControlPlane, die_with_parent, write_kubeconfig
from ..controlplane.pki import ensure_ca, ensure_leaf
from . import configs, diskspace, hostops, images, janitor, network
from .plan import SLOTS, LanePlan, NodePlan

__all__ = ["LaneFailed", "NodeBinaries", "RealNodeLane", "default_node_dir"]

#: Where the lane's runtime state lives (containerd roots, sockets): short paths, on disk.
ROOT_BASE = Path(os.environ.get("KELASTIC_NODE_ROOT", "/var/tmp/kelastic-node"))
BINARIES = (
    "kubelet",
    "kube-proxy",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "runc",
    "kube-router",
    "pause",
)
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
#: Seconds :meth:`Lane.stop` waits for its janitor, and between the lines that say it still does.
JANITOR_WAIT = 600.0
JANITOR_PROGRESS_EVERY = 30.0


class LaneFailed(RuntimeError):
    """A node component failed or never became ready; the message carries its log tail."""


def default_node_dir() -> Path:
    """``$KELASTIC_NODE_DIR``, else where ``make node`` puts the components."""
    if os.environ.get("KELASTIC_NODE_DIR"):
        return Path(os.environ["KELASTIC_NODE_DIR"])
    cache = (
        os.environ.get("KELASTIC_NODE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kelastic" / "node"
    )
    return Path(cache) / "v1.37.2" / "bin"


@dataclass(frozen=True)
class NodeBinaries:
    """The directory ``make node`` fills."""

    directory: Path

    @classmethod
    def find(cls, directory: Path | str) -> NodeBinaries:
        """FileNotFoundError naming what is missing and how to build it."""
        directory = Path(directory).expanduser()
        missing = [b for b in BINARIES if not os.access(directory / b, os.X_OK)]
        missing += [f"cni/{p}" for p in CNI_PLUGINS if not os.access(directory / "cni" / p, os.X_OK)]
        if missing:
            raise FileNotFoundError(
                f"no {', '.join(missing)} in {directory}: run `make node` (it prints the directory; "
                "pass it as $KELASTIC_NODE_DIR)"
            )
        return cls(directory)

    def __getitem__(self, name: str) -> Path:
        return self.directory / name

    @property
    def cni_bin(self) -> Path:
        return self.directory / "cni"


@dataclass
class _Process:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(
                "    " + line for line in self.log.read_text(errors="replace").splitlines()[-lines:]
            )
        return "    (no log)"


@dataclass
class RealNodeLane:
    """N real nodes; see the module docstring. ``stop()`` is idempotent."""

    binaries: NodeBinaries
    nodes: int = 2
    logs_dir: Path = field(default_factory=lambda: Path("/tmp/kelastic-node-logs"))
    progress: Callable[[str], None] = print
    timeout: float = 180.0
    root_base: Path = ROOT_BASE
    plan: LanePlan | None = None
    #: Seconds each setup phase took (printed by the lane's tests).
    timings: dict[str, float] = field(default_factory=dict)
    #: Whether this start built the Debian image (the first lane on a machine: a cold start).
    cold: bool = False
    #: More images for every node: OCI layouts or tars (:mod:`.imagebuild` makes the kelastic
    #: and PyTorch images), imported after the lane's own; layouts in one import, merged, so
    #: that layers they share are unpacked once.
    extra_images: tuple[Path, ...] = ()
    _slot_fd: int | None = None
    _janitor: subprocess.Popen[bytes] | None = None
    _processes: list[_Process] = field(default_factory=list)
    _control_plane: ControlPlane | None = None
    _killed: set[str] = field(default_factory=set)

    # -- prepare: the host side ---------------------------------------------------------------
    def prepare(self) -> LanePlan:
        """Claim a slot, start the janitor, then make the lane's cgroups and network."""
        started = time.monotonic()
        slot, self._slot_fd = hostops.claim_slot(SLOTS)
        plan = LanePlan.make(
            slot, self.nodes, root_base=self.root_base, cgroup_parent=hostops.cgroup_parent()
        )
        self.plan = plan
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._start_janitor(plan)
        # A lane killed before its janitor ran leaves state the janitor of the same slot removes.
        leftovers = janitor.clean(plan)
        if leftovers:
            raise LaneFailed(
                f"slot {slot} holds what an earlier lane left and cannot be removed: {leftovers}"
            )
        hostops.save_sysctls()
        hostops.save_fixed_paths()
        plan.root.mkdir(parents=True, exist_ok=True)
        for node in plan.nodes:
            hostops.make_cgroup(node.runtime_cgroup)
        network.set_up(plan)
        self.timings["host network and cgroups"] = time.monotonic() - started
        self.progress(f"lane {slot}: bridge {plan.bridge} {plan.host_address}, {self.nodes} node namespaces")
        return plan

    def _start_janitor(self, plan: LanePlan) -> None:
        assert self._slot_fd is not None
        log = open(self.logs_dir / "janitor.log", "wb")  # noqa: SIM115 - the janitor's, for its life
        argv = [
            sys.executable, "-m", "kelastic.localcluster.node.janitor",
            f"--slot={plan.slot}", f"--nodes={len(plan.nodes)}",
            f"--root-base={self.root_base}", f"--cgroup-parent={plan.cgroup.rsplit('/', 1)[0] or '/'}",
        ]  # fmt: skip
        self._janitor = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            pass_fds=(self._slot_fd,), start_new_session=True,
        )  # fmt: skip
        log.close()

    def control_plane_settings(self) -> dict[str, Any]:
        """The :class:`ControlPlane` fields real nodes need (address, Service range, controllers)."""
        assert self.plan is not None, "prepare() first"
        return {
            "address": str(self.plan.host_address),
            "service_network": self.plan.service_network,
            "endpoint_controllers": True,
        }

    # -- start: the nodes ---------------------------------------------------------------------
    def start(self, control_plane: ControlPlane) -> None:
        """Start every node and wait until all are Ready; then their firewalls and proxies."""
        assert self.plan is not None, "prepare() first"
        self._control_plane = control_plane
        started = time.monotonic()
        layouts = self._image_layouts()
        self.timings["images"] = time.monotonic() - started
        imports = self._plan_imports(layouts)
        for node in self.plan.nodes:
            self._start_runtime(node)
        # Imports are mostly I/O: the nodes' run side by side, as many as the disk holds.
        with concurrent.futures.ThreadPoolExecutor(imports.side_by_side) as pool:
            for done in [pool.submit(self._import, node, layouts) for node in self.plan.nodes]:
                done.result()
        self.timings["containerd and imports"] = time.monotonic() - started - self.timings["images"]
        mark = time.monotonic()
        for node in self.plan.nodes:
            self._start_kubelet(node, control_plane)
        for node in self.plan.nodes:
            self._wait(f"node {node.name} Ready", functools.partial(self._node_ready, node.name))
        self.timings["kubelets Ready"] = time.monotonic() - mark
        for node in self.plan.nodes:
            self._start_network_agents(node, control_plane)
        self.timings["total"] = time.monotonic() - started
        self.progress(f"{len(self.plan.nodes)} real nodes Ready after {self.timings['total']:.1f} s")

    def _image_layouts(self) -> list[Path]:
        assert self.plan is not None
        pause = self.plan.root / "images" / "pause"
        pause.mkdir(parents=True, exist_ok=True)
        layer = images.pause_layer(self.binaries["pause"], self.plan.root / "images" / "pause.tar")
        images.write_layout(pause, configs.PAUSE_IMAGE, [layer], entrypoint=["/pause"])
        debian = images.cache_dir() / "debian-layout"
        self.cold = not images.debian_layer_path().is_file()
        if not (debian / "index.json").is_file():
            images.write_layout(debian, images.DEBIAN_IMAGE, [images.debian_layer(self.progress)])
        if len(self.extra_images) > 1 and all(p.is_dir() for p in self.extra_images):
            built = self.plan.root / "images" / "built"
            shutil.rmtree(built, ignore_errors=True)
            return [pause, debian, images.merge_layouts(built, self.extra_images)]
        return [pause, debian, *self.extra_images]

    def _plan_imports(self, layouts: list[Path]) -> diskspace.ImportPlan:
        """How many nodes import at once, from the images' bytes and the free space where
        the nodes' containerd roots are (at most ``$KELASTIC_NODE_IMPORTS_AT_ONCE`` where set);
        NotEnoughSpace when even one at a time does not fit."""
        assert self.plan is not None
        image_bytes = images.unique_blob_bytes(layouts)
        free = shutil.disk_usage(self.plan.root).free
        most = int(os.environ.get("KELASTIC_NODE_IMPORTS_AT_ONCE") or 0) or None
        plan = diskspace.plan_imports(image_bytes, len(self.plan.nodes), free, self.plan.root, most=most)
        self.progress(
            f"importing {image_bytes / 1e9:.1f} GB of images into {len(self.plan.nodes)} nodes, "
            f"{plan.side_by_side} at a time: {plan.peak / 1e9:.1f} GB at the peak, {free / 1e9:.1f} GB free"
        )
        return plan

    def _spawn(self, node: NodePlan, name: str, argv: list[str]) -> _Process:
        log = self.logs_dir / f"{node.name}-{name}.log"

        def child() -> None:
            hostops.enter(node.netns, node.runtime_cgroup)
            die_with_parent(signal.SIGKILL)

        env = dict(
            os.environ, PATH=f"{self.binaries.directory}:{os.environ.get('PATH', '/usr/sbin:/usr/bin')}"
        )
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=child, start_new_session=True, env=env,
            )  # fmt: skip
        entry = _Process(f"{node.name}/{name}", proc, log)
        self._processes.append(entry)
        return entry

    def _start_runtime(self, node: NodePlan) -> None:
        assert self.plan is not None
        for sub in ("containerd", "cni/net.d", "kubelet/logs"):
            (node.root / sub).mkdir(parents=True, exist_ok=True)
        config = node.root / "containerd" / "config.toml"
        config.write_text(
            configs.containerd_config(node, runc=self.binaries["runc"], cni_bin=self.binaries.cni_bin)
        )
        (node.root / "cni" / "net.d" / "10-kelastic.conflist").write_text(
            json.dumps(configs.cni_conflist(self.plan, node), indent=1)
        )
        proc = self._spawn(node, "containerd", [str(self.binaries["containerd"]), f"--config={config}"])
        ctr = [str(self.binaries["ctr"]), "-a", str(node.containerd_socket), "version"]
        self._wait(
            f"containerd of {node.name}",
            lambda: subprocess.run(ctr, capture_output=True, timeout=10).returncode == 0,
            proc,
        )

    def _import(self, node: NodePlan, layouts: list[Path]) -> None:
        for layout in layouts:
            mark = time.monotonic()
            extra = layout not in layouts[:2]  # after the pause and Debian images
            images.import_layout(self.binaries["ctr"], node.containerd_socket, layout, discard_layers=extra)
            if extra:
                self.timings[f"import {layout.name} ({node.name})"] = time.monotonic() - mark

    def _start_kubelet(self, node: NodePlan, cp: ControlPlane) -> None:
        pki = cp.pki_dir
        ca = ensure_ca(pki, "ca", "kelastic-local-ca")
        client = ensure_leaf(ca, pki, f"node-{node.name}", f"system:node:{node.name}",
                             organizations=("system:nodes",), client=True)  # fmt: skip
        serving = ensure_leaf(ca, pki, f"kubelet-{node.name}", node.name, server=True,
                              hosts=(str(node.address), node.name))  # fmt: skip
        kubeconfig = write_kubeconfig(node.root / "kubelet.kubeconfig", cp.url, cp.ca_file,
                                      f"system:node:{node.name}", client)  # fmt: skip
        config = node.root / "kubelet" / "config.yaml"
        config.write_text(json.dumps(configs.kubelet_config(
            node, ca_file=cp.ca_file, serving_cert=serving.cert, serving_key=serving.key), indent=1))  # fmt: skip
        self._spawn(node, "kubelet", [
            str(self.binaries["kubelet"]), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--hostname-override={node.name}", f"--node-ip={node.address}",
            f"--root-dir={node.root / 'kubelet' / 'root'}", "--v=1",
        ])  # fmt: skip

    def _start_network_agents(self, node: NodePlan, cp: ControlPlane) -> None:
        assert self.plan is not None
        proxy_kc = write_kubeconfig(node.root / "kube-proxy.kubeconfig", cp.url, cp.ca_file, "kube-proxy",
                                    cp.credentials("kube-proxy"))  # fmt: skip
        self._spawn(node, "kube-router", [
            str(self.binaries["kube-router"]), f"--kubeconfig={cp.admin_kubeconfig}",
            "--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-cni=false",
            f"--hostname-override={node.name}", f"--service-cluster-ip-range={self.plan.service_network}",
            "--v=1",
        ])  # fmt: skip
        self._spawn(node, "kube-proxy", [
            str(self.binaries["kube-proxy"]), "--proxy-mode=nftables", f"--kubeconfig={proxy_kc}",
            f"--hostname-override={node.name}", "--detect-local-mode=BridgeInterface",
            f"--pod-bridge-interface={configs.CNI_BRIDGE}", "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0", "--v=1",
        ])  # fmt: skip

    # -- waiting ------------------------------------------------------------------------------
    def _node_ready(self, name: str) -> bool:
        cp = self._control_plane
        assert cp is not None
        ctx: ssl.SSLContext = cp.ssl_context(cp.credentials("admin"))
        with urllib.request.urlopen(f"{cp.url}/api/v1/nodes/{name}", timeout=5, context=ctx) as resp:
            node = json.loads(resp.read())
        conditions = node.get("status", {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def _wait(self, what: str, ready: Callable[[], bool], proc: _Process | None = None) -> None:
        deadline = time.monotonic() + self.timeout
        next_note = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):
                if ready():
                    return
            for entry in [proc] if proc else self._processes:
                if entry is not None and entry.process.poll() is not None:
                    raise LaneFailed(f"{entry.name} exited with code {entry.process.returncode} while waiting "
                                     f"for {what}; the last lines of {entry.log}:\n{entry.tail()}")  # fmt: skip
            if time.monotonic() > deadline:
                raise LaneFailed(
                    f"timed out after {self.timeout:.0f} s waiting for {what} (logs in {self.logs_dir})"
                )
            if time.monotonic() > next_note:
                self.progress(f"still waiting for {what}")
                next_note = time.monotonic() + 15
            time.sleep(0.2)

    def failed(self) -> list[str]:
        """One line per node component that exited (not of a node :meth:`kill_node` killed)."""
        return [f"{p.name} exited with code {p.process.returncode}:\n{p.tail()}"
                for p in self._processes
                if p.process.poll() is not None and p.name.split("/")[0] not in self._killed]  # fmt: skip

    def kill_node(self, name: str) -> set[int]:
        """A node's sudden death: SIGKILL to its containerd, shims, kubelet, kube-router,
        kube-proxy and containers at once. Its namespace, mounts and state stay, as a
        crashed machine's would, until :meth:`stop`. Returns the processes killed."""
        assert self.plan is not None, "prepare() first"
        node = self.plan.node(name)
        self._killed.add(name)
        return hostops.kill_cgroup(node.cgroup)

    # -- stop ---------------------------------------------------------------------------------
    def stop_components(self, grace: float = 10.0) -> None:
        """SIGTERM the nodes' components and wait up to ``grace`` s for them (idempotent): what
        is left the janitor kills in :meth:`stop`. The control plane stops between the two:
        the components' watches would hold its shutdown, and the bridge :meth:`stop` removes
        carries its own requests on the way out."""
        for entry in reversed(self._processes):
            with contextlib.suppress(ProcessLookupError):
                entry.process.terminate()
        deadline = time.monotonic() + grace
        for entry in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                entry.process.wait(max(0.0, deadline - time.monotonic()))

    def stop(self, grace: float = 10.0) -> list[str]:
        """Stop the components (:meth:`stop_components`, then the janitor's SIGKILL) and remove
        everything.

        Returns what the janitor could not remove (empty when the host is clean).
        """
        self.stop_components(grace)
        watcher, self._janitor = self._janitor, None
        left: list[str] = []
        if watcher is not None and watcher.stdin is not None:
            watcher.stdin.close()
            began = time.monotonic()
            while True:
                # Removing the containers' root filesystems (an image of several GB per node)
                # takes minutes on a loaded machine: wait, saying so, rather than leave it mid-way.
                try:
                    watcher.wait(JANITOR_PROGRESS_EVERY)
                    break
                except subprocess.TimeoutExpired:
                    waited = time.monotonic() - began
                    if waited >= JANITOR_WAIT:
                        raise
                    self.progress(f"the janitor still cleans the lane up ({waited:.0f} s)")
            for p in self._processes:  # reaped: the janitor killed what SIGTERM left
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.process.wait(1)
            text = (self.logs_dir / "janitor.log").read_text(errors="replace")
            left = [
                line.split("left behind: ", 1)[1] for line in text.splitlines() if "left behind: " in line
            ]
        self._processes.clear()
        if self._slot_fd is not None:
            os.close(self._slot_fd)
            self._slot_fd = None
        return left
