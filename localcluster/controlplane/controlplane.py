"""A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver, controller-manager, scheduler.

``kelastic local --control-plane DIR`` runs the official binaries found in
``DIR`` instead of kelastic's API server emulator, so RBAC, admission and the
controllers kelastic does not emulate (Deployments, ReplicaSets, the token
and EndpointSlice controllers, the garbage collector) are judged by the real
thing. :class:`ControlPlane` owns those processes:

- certificates and keys are generated into ``<state_dir>/pki`` (see
  :mod:`kelastic.localcluster.controlplane.pki`): the cluster CA, the front-proxy CA, a
  serving certificate for the API server, client certificates for every
  component, the admin (``system:masters``), the node (``system:node:<name>``)
  and the service proxy (``system:kube-proxy``);
- etcd (``DIR/etcd``, else ``etcd`` on ``PATH``), then kube-apiserver
  (loopback only, https, ``--authorization-mode=Node,RBAC``, service-account
  issuer and keys, the standard admission plugins plus
  ``NodeRestriction``, ``OwnerReferencesPermissionEnforcement`` and
  ``ResourceQuota``), then kube-controller-manager and kube-scheduler when
  ``DIR`` has them; every port is a free one chosen at start;
- every wait has a deadline and prints how long it took; a component that
  exits is reported with the tail of its log (``<state_dir>/logs``);
- components get ``PR_SET_PDEATHSIG`` so they die with the thread that
  started them, and :meth:`ControlPlane.stop` stops them in reverse order
  (SIGTERM, then SIGKILL after a grace period).

Nothing routes ClusterIPs to the API server here and Endpoints may not hold
loopback addresses, so the apiserver runs with ``--endpoint-reconciler-type
none``: in-cluster clients are pointed at ``127.0.0.1:<port>`` directly.

Workload-aware scheduling is on where the binaries offer it: the beta feature gates of
:data:`BETA_GATES` (``GenericWorkload``: ``scheduling.k8s.io/v1beta1`` Workloads and
PodGroups, kube-scheduler's gang scheduling, kube-controller-manager's PodGroup
protection) are turned on for every component whose ``--help`` lists them as beta, and
the API versions they bring are served (``--runtime-config``).

Nothing depends on a version number: the components' flags and feature gates are read
from their ``--help`` (:class:`ComponentHelp`), the served API groups from discovery
(:meth:`ControlPlane.serves`) and what the API server accepts from its answers to a
dry run (:attr:`ControlPlane.loopback_slices`), so any release from 1.20 on is
driven by what it offers. :attr:`ControlPlane.version` (from ``/version``) is for
the messages only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.interrupts import uninterrupted
from ..common.processes import stop_process
from .pki import CertPair, ensure_ca, ensure_leaf, ensure_signing_key

__all__ = [
    "BETA_GATES",
    "ComponentFailed",
    "ComponentHelp",
    "ControlPlane",
    "ControlPlaneBinaries",
    "KubeVersion",
    "component_flags",
    "control_plane_dir",
    "die_with_parent",
    "write_kubeconfig",
]

#: Environment variables naming a directory of control-plane binaries, in order of preference.
DIR_VARIABLES = ("KELASTIC_CONTROL_PLANE", "KUBEBUILDER_ASSETS")
#: The issuer of service-account tokens (what in-cluster clients expect by default).
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
#: Admission plugins on top of the defaults: the ones that hurt operators in real clusters.
ADMISSION_PLUGINS = (
    "NamespaceLifecycle",
    "LimitRanger",
    "ServiceAccount",
    "DefaultTolerationSeconds",
    "Priority",
    "MutatingAdmissionWebhook",
    "ValidatingAdmissionWebhook",
    "ResourceQuota",
    "NodeRestriction",
    "OwnerReferencesPermissionEnforcement",
)
HOST = "127.0.0.1"
LOG_TAIL_LINES = 25
#: Beta feature gates (off by default upstream) turned on where a component's ``--help`` lists
#: them as beta, each with the API versions it needs served. ``GenericWorkload`` (beta since
#: 1.37): kube-scheduler places a ``scheduling.k8s.io/v1beta1`` PodGroup's pods all or nothing
#: (``schedulingPolicy.gang.minCount``), which kelastic's operator uses for its jobs' workers.
BETA_GATES: dict[str, tuple[str, ...]] = {"GenericWorkload": ("scheduling.k8s.io/v1beta1",)}


class ComponentFailed(RuntimeError):
    """A control-plane component exited or never became healthy (the message carries its log tail)."""


@dataclass(frozen=True, order=True)
class KubeVersion:
    """``major.minor.patch`` of the Kubernetes binaries."""

    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> KubeVersion:
        """From ``v1.20.2``, ``Kubernetes v1.31.0-rc.1`` and the like; ValueError otherwise."""
        found = re.search(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text)
        if not found:
            raise ValueError(f"no Kubernetes version in {text!r}")
        return cls(int(found.group(1)), int(found.group(2)), int(found.group(3) or 0))

    def __str__(self) -> str:
        return f"v{self.major}.{self.minor}.{self.patch}"


@dataclass(frozen=True)
class ControlPlaneBinaries:
    """The executables of one control plane; the controller-manager and scheduler are optional."""

    apiserver: Path
    etcd: Path
    controller_manager: Path | None = None
    scheduler: Path | None = None

    @classmethod
    def find(cls, directory: Path | str) -> ControlPlaneBinaries:
        """Look in ``directory`` (etcd also on ``PATH``); raise FileNotFoundError naming what is missing."""
        directory = Path(directory).expanduser()
        if not directory.is_dir():
            raise FileNotFoundError(f"control-plane directory {directory} does not exist")

        def exe(name: str) -> Path | None:
            path = directory / name
            return path if path.is_file() and os.access(path, os.X_OK) else None

        apiserver = exe("kube-apiserver")
        if apiserver is None:
            raise FileNotFoundError(
                f"no executable kube-apiserver in {directory}; point --control-plane (or "
                "$KELASTIC_CONTROL_PLANE / $KUBEBUILDER_ASSETS) at a directory holding kube-apiserver and etcd"
            )
        etcd = exe("etcd") or (Path(found) if (found := shutil.which("etcd")) else None)
        if etcd is None:
            raise FileNotFoundError(
                f"no etcd in {directory} nor on PATH; put an etcd binary (3.4 or newer) in {directory}"
            )
        return cls(apiserver, etcd, exe("kube-controller-manager"), exe("kube-scheduler"))


#: Starts tried when a component finds its port taken (a race with another process).
PORT_ATTEMPTS = 3
#: Seconds a component gets to exit on SIGTERM when its start was broken off (Ctrl-C).
ABORT_GRACE_S = 2.0


def control_plane_dir(flag: Path | str | None = None) -> Path | None:
    """The binaries' directory: ``flag``, else ``$KELASTIC_CONTROL_PLANE``, else ``$KUBEBUILDER_ASSETS``."""
    if flag:
        return Path(flag).expanduser()
    for variable in DIR_VARIABLES:
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    return None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    # In the child, before exec: ``sig`` when the thread that started us ends,
    # so no component outlives a kelastic that was killed without cleaning up.
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig)


def _kill_with_parent() -> None:
    die_with_parent(signal.SIGKILL)


#: Components told of kelastic's death by SIGTERM, to stop cleanly; the others get SIGKILL:
#: they keep nothing, and kube-apiserver v1.37 began a graceful shutdown on SIGTERM that
#: never ended once etcd, dying with it, was gone (it lingered, holding its port).
GRACEFUL_ON_PARENT_DEATH = frozenset({"etcd"})


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` right now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def write_kubeconfig(
    path: Path, server: str, ca: Path, user: str, client: CertPair | None = None, token: str | None = None
) -> Path:
    """A kubeconfig with embedded CA and credentials (client certificate or bearer token), mode 0600."""
    import base64

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    credentials: dict[str, str] = {}
    if client is not None:
        credentials = {
            "client-certificate-data": b64(client.cert_pem()),
            "client-key-data": b64(client.key_pem()),
        }
    if token is not None:
        credentials["token"] = token
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kelastic-local",
                "cluster": {"server": server, "certificate-authority-data": b64(ca.read_bytes())},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "kelastic-local", "context": {"cluster": "kelastic-local", "user": user}}],
        "current-context": "kelastic-local",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, indent=1)  # JSON is YAML: kubectl and every client read it
    return path


@dataclass
class _Component:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "    (no log)"
        return "\n".join(f"    {line}" for line in text)


@dataclass
class ControlPlane:
    """etcd + kube-apiserver (+ controller-manager, scheduler) on 127.0.0.1; see the module docstring.

    ``service_network`` becomes ``--service-cluster-ip-range``; ``node_name``
    is the node whose client certificate is made (``system:node:<name>``).
    ``progress`` receives one line per step. Use ``start()``/``stop()`` or a
    ``with`` block; ``stop()`` is idempotent.
    """

    binaries: ControlPlaneBinaries
    state_dir: Path
    service_network: ipaddress.IPv4Network = field(
        default_factory=lambda: ipaddress.IPv4Network("127.2.0.0/21")
    )
    node_name: str = "kelastic-local"
    progress: Callable[[str], None] = print
    timeout: float = 90.0
    stop_grace: float = 10.0
    url: str = ""
    version: KubeVersion | None = None
    #: Served ``group/version`` strings (``v1`` for the core group), from discovery.
    api_versions: set[str] = field(default_factory=set)
    #: Whether the API server takes a loopback address in an EndpointSlice (1.20.2 does;
    #: every release since 1.21 refuses it, like it refuses one in Endpoints).
    loopback_slices: bool = False
    startup_seconds: float = 0.0
    #: etcd's data directory (default ``<state_dir>/etcd``); a tmpfs directory spares a
    #: disposable cluster etcd's fsyncs, which stall it on a busy disk.
    etcd_data: Path | None = None
    #: The API server's port (0: a free one).
    api_port: int = 0
    #: The beta gates to turn on where the binaries know them ({} keeps every default).
    beta_gates: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(BETA_GATES))
    #: The feature gates turned on, as the API server's ``--help`` offered them.
    gates_on: tuple[str, ...] = ()
    #: Where kube-apiserver binds and what it advertises (also in its certificate): loopback,
    #: or a bridge address that real nodes and their pods reach (``kelastic.localcluster.node``).
    address: str = HOST
    #: Real nodes: the Endpoints and EndpointSlice controllers on, and the ``kubernetes``
    #: Service's endpoints kept by the API server (pods reach it through its ClusterIP).
    endpoint_controllers: bool = False
    #: Seconds a node may go without a heartbeat (its Lease or status) before the
    #: controller-manager reads it NotReady (``--node-monitor-grace-period``): patient with a
    #: busy 2-core machine by default.
    node_monitor_grace: float = 60.0
    _components: list[_Component] = field(default_factory=list)

    # -- paths ----------------------------------------------------------------
    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def ca_file(self) -> Path:
        return self.pki_dir / "ca.crt"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1]) if self.url else 0

    def credentials(self, who: str) -> CertPair:
        """Client certificate of ``admin``, ``node`` (system:node:<name>) or ``kube-proxy``."""
        return CertPair(self.pki_dir / f"{who}.crt", self.pki_dir / f"{who}.key")

    def serves(self, group_version: str) -> bool:
        """Whether discovery lists ``group_version`` (e.g. ``discovery.k8s.io/v1``)."""
        return group_version in self.api_versions

    # -- start ----------------------------------------------------------------
    def start(self) -> ControlPlane:
        started = time.monotonic()
        self.state_dir = self.state_dir.resolve()
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        etcd_data = self.etcd_data or self.state_dir / "etcd"
        fresh = not (etcd_data.is_dir() and any(etcd_data.iterdir()))
        member = self._etcd_member_name(fresh)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._start(started, member)
                break
            except ComponentFailed as exc:
                self.stop()
                # Free ports are picked before the components bind them, so another process
                # can take one in between: pick new ones rather than fail the whole start.
                if "address already in use" not in str(exc) or attempt == PORT_ATTEMPTS:
                    raise
                self.progress(f"a port was taken while starting ({attempt}/{PORT_ATTEMPTS}): retrying")
                if fresh:  # etcd's half-made member under the old ports must not be reused
                    shutil.rmtree(etcd_data, ignore_errors=True)
                self.url, self.version = "", None
            except BaseException as exc:
                # Broken off (Ctrl-C): the components are half-started, nothing to wind down gently.
                self.stop(None if isinstance(exc, Exception) else ABORT_GRACE_S)
                raise
        self.startup_seconds = time.monotonic() - started
        gates = f", feature gates {', '.join(self.gates_on)} on" if self.gates_on else ""
        self.progress(
            f"control plane {self.version} ready after {self.startup_seconds:.1f} s: {self.url} "
            f"(logs in {self.logs_dir}{gates})"
        )
        return self

    @property
    def etcd_member_file(self) -> Path:
        """Where the etcd member's name is kept, next to the data it names."""
        return self.state_dir / "etcd-member"

    def _etcd_member_name(self, fresh: bool) -> str:
        """The etcd member's name: the one recorded with the data being reused, else a new one.

        One name per data directory, so that a reused state directory restarts the same
        member (and the health check below recognises it) instead of a renamed one.
        """
        if not fresh and self.etcd_data is None:
            with contextlib.suppress(OSError):
                recorded = self.etcd_member_file.read_text().strip()
                if re.fullmatch(r"kelastic-[0-9a-f]+", recorded):
                    return recorded
        # Random: it also tells our etcd from another cluster's that won the race for a port.
        member = f"kelastic-{secrets.token_hex(4)}"
        self.etcd_member_file.write_text(member + "\n")
        return member

    def _start(self, started: float, member: str) -> None:
        version = _binary_version(self.binaries.apiserver)
        self._make_pki()
        etcd_port, peer_port = free_port(), free_port()
        api_port = self.api_port or free_port(self.address)
        self.url = f"https://{self.address}:{api_port}"
        etcd = self._spawn("etcd", self._etcd_argv(etcd_port, peer_port, member))
        # Ours, not another cluster's etcd that won the race for a free port: its member name.
        self._wait(etcd, "etcd /health", lambda: _etcd_member(f"http://{HOST}:{etcd_port}") == member)
        self.progress(f"etcd healthy after {time.monotonic() - started:.1f} s")
        apiserver = self._spawn("kube-apiserver", self._apiserver_argv(etcd_port, api_port))
        admin_ctx = self.ssl_context(self.credentials("admin"))
        self._wait(
            apiserver, "kube-apiserver /readyz", lambda: _get(self.url + "/readyz", admin_ctx) == b"ok"
        )
        # /readyz can answer ok before the API server's own bootstrap controller has created
        # namespace default, where a user's first apply goes.
        self._wait(
            apiserver,
            "namespace default",
            lambda: _exists(self.url + "/api/v1/namespaces/default", admin_ctx),
        )
        self.progress(f"kube-apiserver ready after {time.monotonic() - started:.1f} s")
        write_kubeconfig(self.admin_kubeconfig, self.url, self.ca_file, "admin", self.credentials("admin"))
        self._discover(admin_ctx)
        if self.version is None:
            self.version = version
        self.loopback_slices = self._takes_loopback_slices(admin_ctx)
        waits: list[tuple[_Component, str, int]] = []
        for name, binary in (
            ("kube-controller-manager", self.binaries.controller_manager),
            ("kube-scheduler", self.binaries.scheduler),
        ):
            if binary is None:
                self.progress(f"no {name} in {self.binaries.apiserver.parent}: not started")
                continue
            port = free_port()
            waits.append((self._spawn(name, self._component_argv(name, binary, port)), name, port))
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # their self-signed serving certificates: health only
        for component, name, port in waits:

            def healthy(p: int = port, c: _Component = component) -> bool:
                # Still running too: a port lost to another process would answer for it.
                alive = c.process is not None and c.process.poll() is None
                return alive and _get(f"https://{HOST}:{p}/healthz", insecure) == b"ok"

            self._wait(component, f"{name} /healthz", healthy)
            self.progress(f"{name} healthy after {time.monotonic() - started:.1f} s")
        if self.binaries.controller_manager is not None:
            # Pods are refused until their namespace's default ServiceAccount exists.
            self._wait(
                None,
                "the default ServiceAccount of namespace default",
                lambda: _exists(self.url + "/api/v1/namespaces/default/serviceaccounts/default", admin_ctx),
            )

    def _make_pki(self) -> None:
        pki = self.pki_dir
        ca = ensure_ca(pki, "ca", "kelastic-local-ca")
        front = ensure_ca(pki, "front-proxy-ca", "kelastic-local-front-proxy-ca")
        first_service_ip = str(self.service_network.network_address + 1)
        ensure_leaf(
            ca,
            pki,
            "apiserver",
            "kube-apiserver",
            server=True,
            hosts=(
                HOST,
                *((self.address,) if self.address != HOST else ()),
                "localhost",
                first_service_ip,
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
        )
        ensure_leaf(ca, pki, "admin", "kelastic-admin", organizations=("system:masters",), client=True)
        ensure_leaf(ca, pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                    organizations=("system:masters",), client=True)  # fmt: skip
        ensure_leaf(ca, pki, "kube-controller-manager", "system:kube-controller-manager", client=True)
        ensure_leaf(ca, pki, "kube-scheduler", "system:kube-scheduler", client=True)
        ensure_leaf(ca, pki, "kube-proxy", "system:kube-proxy", client=True)
        ensure_leaf(ca, pki, "node", f"system:node:{self.node_name}", organizations=("system:nodes",),
                    client=True)  # fmt: skip
        ensure_leaf(ca, pki, "kubelet-serving", self.node_name, server=True, hosts=(HOST, self.node_name))
        ensure_leaf(front, pki, "front-proxy-client", "front-proxy-client", client=True)
        ensure_signing_key(pki, "sa")

    def _etcd_argv(self, port: int, peer_port: int, member: str) -> list[str]:
        data = self.etcd_data or self.state_dir / "etcd"
        data.mkdir(parents=True, exist_ok=True)
        data.chmod(0o700)
        return [
            str(self.binaries.etcd),
            f"--name={member}",
            f"--data-dir={data}",
            f"--listen-client-urls=http://{HOST}:{port}",
            f"--advertise-client-urls=http://{HOST}:{port}",
            f"--listen-peer-urls=http://{HOST}:{peer_port}",
            f"--initial-advertise-peer-urls=http://{HOST}:{peer_port}",
            f"--initial-cluster={member}=http://{HOST}:{peer_port}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
        ]

    def _apiserver_argv(self, etcd_port: int, port: int) -> list[str]:
        pki = self.pki_dir
        offered = ComponentHelp.of(self.binaries.apiserver)
        self.gates_on = tuple(g for g in self.beta_gates if offered.gates.get(g) == BETA)
        return [
            str(self.binaries.apiserver),
            f"--etcd-servers=http://{HOST}:{etcd_port}",
            f"--bind-address={self.address}",
            f"--secure-port={port}",
            f"--advertise-address={self.address}",
            # Endpoints may not hold 127.0.0.1: no endpoints for the kubernetes Service
            # unless it is advertised on an address pods reach (real nodes).
            f"--endpoint-reconciler-type={'lease' if self.endpoint_controllers else 'none'}",
            f"--cert-dir={self.state_dir / 'certdir'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-account-issuer={SA_ISSUER}",
            "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={self.service_network}",
            f"--enable-admission-plugins={','.join(ADMISSION_PLUGINS)}",
            "--allow-privileged=true",
            "--v=1",
            *component_flags("kube-apiserver", offered, loopback_slices=False, gates=self.beta_gates),
        ]

    def _component_argv(self, name: str, binary: Path, port: int) -> list[str]:
        kubeconfig = self.state_dir / f"{name}.kubeconfig"
        write_kubeconfig(kubeconfig, self.url, self.ca_file, name, self.credentials(name))
        argv = [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--bind-address={HOST}",
            f"--secure-port={port}",
            f"--cert-dir={self.state_dir / 'certdir' / name}",
            "--leader-elect=false",
            "--v=1",
        ]
        argv += component_flags(
            name,
            ComponentHelp.of(binary),
            loopback_slices=self.loopback_slices,
            gates=self.beta_gates,
            endpoints=self.endpoint_controllers,
        )
        if name == "kube-controller-manager":
            pki = self.pki_dir
            argv += [
                f"--client-ca-file={pki / 'ca.crt'}",
                "--use-service-account-credentials",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                f"--flex-volume-plugin-dir={self.state_dir / 'flexvolume'}",
                # The node heartbeats through its Lease; be patient with a busy 2-core machine.
                f"--node-monitor-grace-period={self.node_monitor_grace:g}s",
            ]
        return argv

    def _spawn(self, name: str, argv: list[str]) -> _Component:
        component = _Component(name, argv, self.logs_dir / f"{name}.log")
        # Started and recorded in one piece: a Ctrl-C in between would leave it unknown to stop().
        with uninterrupted(), open(component.log_path, "ab") as log:
            component.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent if name in GRACEFUL_ON_PARENT_DEATH else _kill_with_parent,
                # Not in our process group: a terminal's Ctrl-C is for kelastic, which then
                # stops the components in order (they would otherwise die mid-start or first).
                start_new_session=True,
            )
            self._components.append(component)
        return component

    def _wait(self, component: _Component | None, what: str, ready: Callable[[], bool]) -> None:
        """Poll ``ready`` until true; fail when ``component`` exits or the deadline passes."""
        deadline = time.monotonic() + self.timeout
        next_note = time.monotonic() + 10.0
        while True:
            with contextlib.suppress(OSError, ValueError, ssl.SSLError, urllib.error.URLError):
                if ready():
                    return
            if (
                component is not None
                and component.process is not None
                and component.process.poll() is not None
            ):
                raise ComponentFailed(
                    f"{component.name} exited with code {component.process.returncode} while waiting for "
                    f"{what}; the last lines of {component.log_path}:\n{component.tail()}"
                )
            now = time.monotonic()
            if now >= deadline:
                tail = f"; the last lines of {component.log_path}:\n{component.tail()}" if component else ""
                raise ComponentFailed(f"timed out after {self.timeout:.0f} s waiting for {what}{tail}")
            if now >= next_note:
                self.progress(f"still waiting for {what} ({now - deadline + self.timeout:.0f} s)")
                next_note = now + 10.0
            time.sleep(0.1)

    def _discover(self, ctx: ssl.SSLContext) -> None:
        info = json.loads(_get(self.url + "/version", ctx))
        self.version = KubeVersion.parse(str(info.get("gitVersion", "")))
        groups = json.loads(_get(self.url + "/apis", ctx)).get("groups") or []
        self.api_versions = {"v1"} | served_versions(groups)

    def _takes_loopback_slices(self, ctx: ssl.SSLContext) -> bool:
        """Whether a dry-run EndpointSlice with a pod address of ours (127.1.0.1) is accepted."""
        for version in ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"):
            if not self.serves(version):
                continue
            probe = {
                "apiVersion": version,
                "kind": "EndpointSlice",
                "metadata": {"name": "kelastic-loopback-probe"},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["127.1.0.1"]}],
                "ports": [],
            }
            request = urllib.request.Request(
                f"{self.url}/apis/{version}/namespaces/default/endpointslices?dryRun=All",
                data=json.dumps(probe).encode(),
                method="POST",
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=10, context=ctx):
                    return True
            except urllib.error.HTTPError as exc:
                if exc.code == 422:
                    return False
                raise ComponentFailed(
                    f"kube-apiserver answered {exc.code} to a dry-run EndpointSlice"
                ) from exc
        return False

    # -- running --------------------------------------------------------------
    def ssl_context(self, client: CertPair | None = None) -> ssl.SSLContext:
        """A TLS context trusting the cluster CA, presenting ``client`` when given."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        if client is not None:
            ctx.load_cert_chain(str(client.cert), str(client.key))
        return ctx

    def failed(self) -> list[str]:
        """One line per component that exited, with its exit code and log tail."""
        return [
            f"{c.name} exited with code {c.process.returncode}; the last lines of {c.log_path}:\n{c.tail()}"
            for c in self._components
            if c.process is not None and c.process.poll() is not None
        ]

    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self._components if c.process is not None}

    def stop(self, grace: float | None = None) -> None:
        """Stop every component, last started first: SIGTERM, then SIGKILL after ``grace`` (default ``stop_grace``)."""
        grace = self.stop_grace if grace is None else grace
        for component in reversed(self._components):
            if component.process is not None:
                stop_process(component.process, grace, name=component.name, progress=self.progress)
        self._components.clear()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


#: A feature gate's maturity as ``--help`` prints it: ``GenericWorkload=true|false (BETA - default=false)``.
BETA = "BETA"


@dataclass(frozen=True)
class ComponentHelp:
    """What a component binary offers, read from its ``--help``: its flags, its feature gates
    (name → maturity: ALPHA, BETA, GA, DEPRECATED) and, for kube-controller-manager, the
    names of its controllers."""

    flags: frozenset[str]
    controllers: tuple[str, ...] = ()
    gates: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> ComponentHelp:
        flags = frozenset(re.findall(r"^\s+(?:-\w, )?--([a-z0-9][a-z0-9-]*)", text, re.MULTILINE))
        found = re.search(r"All controllers: ([^\n]*)", text)
        controllers = tuple(n.strip() for n in found.group(1).split(",")) if found else ()
        # 1.37 prefixes each gate with its component (kube:GenericWorkload=...), 1.20 does not.
        gates = dict(re.findall(r"(?:[a-z]+:)?\b([A-Z][A-Za-z0-9]*)=true\|false \(([A-Z]+)\b", text))
        return cls(flags, tuple(n for n in controllers if n), gates)

    @classmethod
    def of(cls, binary: Path) -> ComponentHelp:
        try:
            out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ComponentFailed(f"cannot run {binary} --help: {exc}") from exc
        return cls.parse(out.stdout + out.stderr)

    def controller(self, *names: str) -> str | None:
        """The first of ``names`` this controller-manager knows (releases renamed them)."""
        return next((n for n in names if n in self.controllers), None)


#: The Endpoints and EndpointSlice controllers' names: canonical since 1.28, short before.
ENDPOINTS_CONTROLLER = ("endpoints-controller", "endpoint")
ENDPOINTSLICE_CONTROLLER = ("endpointslice-controller", "endpointslice")


def component_flags(
    component: str,
    offered: ComponentHelp,
    *,
    loopback_slices: bool,
    gates: Mapping[str, tuple[str, ...]] = BETA_GATES,
    endpoints: bool = False,
) -> list[str]:
    """The flags of ``component`` (kube-apiserver, kube-controller-manager, kube-scheduler) that
    depend on what its binary offers and its API server accepts.

    - ``--feature-gates`` turns on those of ``gates`` the binary lists as beta, and the API
      server serves the API versions they bring (``--runtime-config``); a binary that does not
      know a gate, or knows it at another maturity, keeps its default.
    - ``--port=0`` turns off the insecure HTTP port where the binary still has one (up to
      1.23, on by default there).
    - the controller-manager runs every default controller but those that would only fail
      and warn for every Service: the Endpoints one (Endpoints may not hold our loopback pod
      addresses), and the EndpointSlice one where the API server refuses them in slices
      too (``loopback_slices`` False). The service proxy finds the pods itself. With
      ``endpoints`` (real nodes: pods have routable addresses) both stay on.
    """
    on = [g for g in gates if offered.gates.get(g) == BETA]
    flags = ["--feature-gates=" + ",".join(f"{g}=true" for g in on)] if on else []
    if component == "kube-apiserver":
        apis = [api for g in on for api in gates[g]]
        return flags + (["--runtime-config=" + ",".join(f"{api}=true" for api in apis)] if apis else [])
    flags += ["--port=0"] if "port" in offered.flags else []
    if component == "kube-controller-manager":
        off = [] if endpoints else [offered.controller(*ENDPOINTS_CONTROLLER)]
        if not loopback_slices and not endpoints:
            off.append(offered.controller(*ENDPOINTSLICE_CONTROLLER))
        flags.append("--controllers=" + ",".join(["*", *(f"-{name}" for name in off if name)]))
    return flags


def _binary_version(binary: Path) -> KubeVersion:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ComponentFailed(f"cannot run {binary} --version: {exc}") from exc
    try:
        return KubeVersion.parse(out.stdout + out.stderr)
    except ValueError:
        raise ComponentFailed(
            f"{binary} --version printed no Kubernetes version: {(out.stdout + out.stderr).strip()[:200]}"
        ) from None


def _get(url: str, ctx: ssl.SSLContext | None = None) -> bytes:
    with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
        return bytes(resp.read())


def _etcd_member(url: str) -> str:
    """The name of the (single) member of the etcd at ``url``, once it is healthy; "" before."""
    if b'"health":"true"' not in _get(url + "/health"):
        return ""
    request = urllib.request.Request(url + "/v3/cluster/member/list", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=5) as resp:
        members = json.loads(resp.read()).get("members") or []
    return str(members[0].get("name", "")) if len(members) == 1 else ""


def _exists(url: str, ctx: ssl.SSLContext) -> bool:
    try:
        _get(url, ctx)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise
    return True


def served_versions(groups: Iterable[dict[str, Any]]) -> set[str]:
    """``group/version`` strings of an ``APIGroupList``'s groups."""
    return {str(v.get("groupVersion")) for g in groups for v in g.get("versions") or []}
