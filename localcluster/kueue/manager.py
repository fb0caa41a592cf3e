"""Run the Kueue manager against a :class:`~kelastic.localcluster.controlplane.ControlPlane`."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kelastic.localcluster.common.processes import stop_process
from kelastic.localcluster.controlplane.controlplane import HOST, ControlPlane, die_with_parent, free_port
from kelastic.localcluster.kueue.pki import kueue_certificates

__all__ = [
    "ELASTICJOB_FRAMEWORK",
    "KueueBinaries",
    "KueueFailed",
    "KueueManager",
    "KueueUnsupported",
    "find_kueue_dir",
]

#: The ElasticJob kind in Kueue's ``integrations.externalFrameworks`` (Kind.version.group):
#: Kueue then knows the kind's controller manages its Workloads (kelastic's operator), and
#: leaves pods owned by an ElasticJob alone.
ELASTICJOB_FRAMEWORK = "ElasticJob.v1alpha1.kelastic.dev"
NAMESPACE = "kueue-system"
#: Where ``make kueue`` builds: <root>/<version>/{bin,crds,webhook}.
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kelastic" / "kueue"
MARKER = ".kelastic-complete"
#: Kueue's own API: the webhooks registered (those of job kinds are not).
OWN_API_PATH = "-kueue-x-k8s-io-"
#: The names Kueue's certificate management looks for (its Service is never called: the
#: webhooks are registered at the manager's loopback address).
WEBHOOK_SERVICE = "kueue-webhook-service"
WEBHOOK_SECRET = "kueue-webhook-server-cert"
#: The CRDs Kueue serves conversion for (its certificate management injects their CA).
CONVERTED = ("localqueues", "clusterqueues", "workloads", "cohorts", "multikueueclusters")


class KueueFailed(RuntimeError):
    """The manager exited or never became ready (the message carries its log tail)."""


class KueueUnsupported(KueueFailed):
    """The API server refuses Kueue's CRDs (422): a release older than this Kueue supports."""


@dataclass(frozen=True)
class KueueBinaries:
    """A directory ``make kueue`` built: ``bin/kueue``, ``crds/*.yaml``, ``webhook/manifests.yaml``."""

    directory: Path
    version: str

    @property
    def manager(self) -> Path:
        return self.directory / "bin" / "kueue"

    @property
    def crds(self) -> list[Path]:
        return sorted((self.directory / "crds").glob("*.yaml"))

    @property
    def webhooks(self) -> Path:
        return self.directory / "webhook" / "manifests.yaml"

    @classmethod
    def find(cls, directory: Path | str) -> KueueBinaries:
        path = Path(directory).expanduser().resolve()
        if not (path / "bin" / "kueue").is_file() or not list((path / "crds").glob("*.yaml")):
            raise FileNotFoundError(
                f"{path} holds no Kueue build (bin/kueue and crds/); run `make kueue`, which prints the directory"
            )
        marker = path / MARKER
        version = marker.read_text().split()[-1] if marker.is_file() else path.name
        return cls(path, version)


def find_kueue_dir(flag: Path | str | None = None) -> Path | None:
    """The Kueue build to use: ``flag``, else ``$KELASTIC_KUEUE``, else the newest complete one ``make kueue`` built."""
    named = flag or os.environ.get("KELASTIC_KUEUE")
    if named:
        return Path(named).expanduser()
    if not CACHE_ROOT.is_dir():
        return None

    def release(path: Path) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in path.name.lstrip("v").split("."))
        except ValueError:
            return ()

    built = [p for p in CACHE_ROOT.iterdir() if (p / MARKER).is_file() and (p / "bin" / "kueue").is_file()]
    return max(built, key=release) if built else None


@dataclass
class KueueManager:
    """Kueue's manager beside ``control_plane``; see the package docstring.

    ``wait_for_pods_ready`` (seconds) turns on Kueue's ``waitForPodsReady``: an admitted
    Workload whose pods are not all ready in that time is evicted and requeued, and no other
    Workload is admitted meanwhile (``blockAdmission``): Kueue's all-or-nothing admission.
    ``feature_gates`` are passed as ``--feature-gates``.
    """

    binaries: KueueBinaries
    control_plane: ControlPlane
    state_dir: Path
    progress: Callable[[str], None] = print
    wait_for_pods_ready: float | None = None
    feature_gates: Mapping[str, bool] = field(default_factory=dict)
    timeout: float = 90.0
    process: subprocess.Popen[bytes] | None = None
    health_port: int = 0
    webhook_port: int = 0
    startup_seconds: float = 0.0

    @property
    def log_path(self) -> Path:
        return self.state_dir / "kueue.log"

    # -- the API, as the cluster's admin --------------------------------------
    def _ctx(self) -> ssl.SSLContext:
        cp = self.control_plane
        return cp.ssl_context(cp.credentials("admin"))

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.control_plane.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30, context=self._ctx()) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def _ensure(self, path: str, obj: Mapping[str, Any]) -> None:
        """Create ``obj`` at ``path``, or replace it with this version when it exists."""
        status, answer = self._call("POST", path, obj)
        if status == 409:
            name = obj["metadata"]["name"]
            _, current = self._call("GET", f"{path}/{name}")
            update = {
                **obj,
                "metadata": {**obj["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]},
            }
            status, answer = self._call("PUT", f"{path}/{name}", update)
        if status >= 300:
            raise KueueFailed(
                f"creating {obj.get('kind')} {obj['metadata']['name']} failed ({status}): {answer.get('message', answer)}"
            )

    # -- start and stop -------------------------------------------------------
    def start(self) -> KueueManager:
        started = time.monotonic()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.health_port, self.webhook_port = free_port(), free_port()
        ca_pem = self._seed_certificates()
        self.progress(f"installing Kueue {self.binaries.version}'s {len(self.binaries.crds)} CRDs")
        for path in self.binaries.crds:
            try:
                self._ensure(
                    "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", self._crd(path, ca_pem)
                )
            except KueueFailed as exc:
                if "failed (422)" not in str(exc):
                    raise
                raise KueueUnsupported(
                    f"the API server ({self.control_plane.version}) refuses Kueue {self.binaries.version}'s CRDs: "
                    f"run Kueue on a newer Kubernetes (make control-plane builds one); {str(exc)[:300]}"
                ) from None
        self._wait("Kueue's CRDs to be established", self._crds_established)
        self._register_webhooks(ca_pem)
        certs = self.state_dir / "kueue-certs"
        config = self.state_dir / "kueue-config.yaml"
        config.write_text(yaml.safe_dump(self._config(certs)))
        argv = [
            str(self.binaries.manager),
            f"--config={config}",
            f"--kubeconfig={self.control_plane.admin_kubeconfig}",
            "--zap-log-level=2",
        ]
        if self.feature_gates:
            argv.append(
                "--feature-gates=" + ",".join(f"{k}={str(v).lower()}" for k, v in self.feature_gates.items())
            )
        self.progress(f"starting Kueue {self.binaries.version} (log {self.log_path})")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
                start_new_session=True,
            )
        try:
            self._wait("Kueue's readiness (/readyz)", self._ready)
            self._wait("Kueue's webhooks to answer", self._webhooks_answer)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        self.progress(f"Kueue {self.binaries.version} ready after {self.startup_seconds:.1f} s")
        return self

    def stop(self, grace: float = 10.0) -> None:
        if self.process is not None:
            stop_process(self.process, grace, name="Kueue", progress=self.progress)
        self.process = None

    def __enter__(self) -> KueueManager:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- parts ------------------------------------------------------------------
    def _seed_certificates(self) -> bytes:
        """Kueue's webhook Secret, made before Kueue starts: a CA named as Kueue's own
        (``kueue-ca``) and a serving certificate for its Service's name and for 127.0.0.1.
        Kueue finds them valid and keeps them; the API server reaches its webhooks at the
        loopback address. Returns the CA certificate (PEM)."""
        ca, leaf = kueue_certificates(self.state_dir / "pki", f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc", HOST)
        self._ensure(
            "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        )
        data = {
            "ca.crt": ca.cert.read_bytes(),
            "ca.key": ca.key.read_bytes(),
            "tls.crt": leaf.cert.read_bytes(),
            "tls.key": leaf.key.read_bytes(),
        }
        self._ensure(
            f"/api/v1/namespaces/{NAMESPACE}/secrets",
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": WEBHOOK_SECRET, "namespace": NAMESPACE},
                "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
            },
        )
        # What the kubelet would mount from the Secret: Kueue waits for these files.
        certs = self.state_dir / "kueue-certs"
        certs.mkdir(parents=True, exist_ok=True)
        for name, content in data.items():
            (certs / name).write_bytes(content)
            (certs / name).chmod(0o600)
        return data["ca.crt"]

    def _crd(self, path: Path, ca_pem: bytes) -> dict[str, Any]:
        """A CRD of Kueue's; those Kueue converts get their conversion webhook at the loopback address."""
        crd: dict[str, Any] = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "conversionReviewVersions": ["v1"],
                    "clientConfig": {
                        "url": f"https://{HOST}:{self.webhook_port}/convert",
                        "caBundle": base64.b64encode(ca_pem).decode(),
                    },
                },
            }
        return crd

    def _config(self, certs: Path) -> dict[str, Any]:
        config: dict[str, Any] = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"{HOST}:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": HOST, "port": self.webhook_port, "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            # Kueue's own certificate management, seeded with a certificate that is also valid
            # for 127.0.0.1 (see _seed_certificates): with it off, Kueue insists on metrics
            # certificates at a fixed path under /etc.
            "internalCertManagement": {
                "enable": True,
                "webhookServiceName": WEBHOOK_SERVICE,
                "webhookSecretName": WEBHOOK_SECRET,
            },
            "visibilityServer": {"bindPort": free_port()},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": [], "externalFrameworks": [ELASTICJOB_FRAMEWORK]},
        }
        if self.wait_for_pods_ready is not None:
            config["waitForPodsReady"] = {
                "timeout": f"{self.wait_for_pods_ready:g}s",
                "blockAdmission": True,
                "requeuingStrategy": {
                    "timestamp": "Eviction",
                    "backoffBaseSeconds": 5,
                    "backoffMaxSeconds": 30,
                },
            }
        return config

    def _register_webhooks(self, ca_pem: bytes) -> None:
        bundle = base64.b64encode(ca_pem).decode()
        for doc in yaml.safe_load_all(self.binaries.webhooks.read_text()):
            if not doc:
                continue
            hooks = []
            for hook in doc.get("webhooks") or []:
                path = hook["clientConfig"]["service"]["path"]
                if OWN_API_PATH not in path:
                    continue
                hook = dict(hook)
                hook["clientConfig"] = {
                    "url": f"https://{HOST}:{self.webhook_port}{path}",
                    "caBundle": bundle,
                }
                hook["timeoutSeconds"] = 10
                hooks.append(hook)
            kind = doc["kind"]
            plural = (
                "mutatingwebhookconfigurations"
                if kind.startswith("Mutating")
                else "validatingwebhookconfigurations"
            )
            obj = {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": kind,
                # The names Kueue's certificate management keeps the CA of.
                "metadata": {"name": f"kueue-{doc['metadata']['name']}"},
                "webhooks": hooks,
            }
            self._ensure(f"/apis/admissionregistration.k8s.io/v1/{plural}", obj)

    def _crds_established(self) -> bool:
        for path in self.binaries.crds:
            name = yaml.safe_load(path.read_text())["metadata"]["name"]
            status, crd = self._call("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conditions = (crd.get("status") or {}).get("conditions") or []
            if status != 200 or not any(
                c.get("type") == "Established" and c.get("status") == "True" for c in conditions
            ):
                return False
        return True

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"http://{HOST}:{self.health_port}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)

    def _webhooks_answer(self) -> bool:
        """A dry-run ResourceFlavor goes through Kueue's webhooks (the API server calls them)."""
        flavor = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "kelastic-probe"},
        }
        status, _ = self._call("POST", "/apis/kueue.x-k8s.io/v1beta2/resourceflavors?dryRun=All", flavor)
        return status in (200, 201)

    def _wait(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.timeout
        next_note = time.monotonic() + 10.0
        while True:
            with contextlib.suppress(OSError, ValueError, ssl.SSLError, urllib.error.URLError, KeyError):
                if ready():
                    return
            if self.process is not None and self.process.poll() is not None:
                raise KueueFailed(
                    f"Kueue exited with code {self.process.returncode} while waiting for {what}; "
                    f"the last lines of {self.log_path}:\n{self._tail()}"
                )
            now = time.monotonic()
            if now >= deadline:
                raise KueueFailed(
                    f"timed out after {self.timeout:.0f} s waiting for {what}; log {self.log_path}:\n{self._tail()}"
                )
            if now >= next_note:
                self.progress(f"still waiting for {what} ({now - deadline + self.timeout:.0f} s)")
                next_note = now + 10.0
            time.sleep(0.2)

    def _tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "    (no log)"
        return "\n".join(f"    {line}" for line in text)
