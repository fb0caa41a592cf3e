"""``kelastic-operator``: run the ElasticJob operator (kopf) in the foreground.

Watches ElasticJobs, and the pods and Services they own, in the namespaces named
with ``--namespace`` (repeatable) or in all of them with ``--all-namespaces``.
Several replicas may run: by default they elect a leader on a Lease and only the
leader acts; ``--standalone`` skips the election (one replica, or tests).
SIGTERM/SIGINT stop it cleanly (the Lease is released for a fast takeover).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kelastic.agent.contract import DEFAULT_HEALTH_PORT
from kelastic.operator.builders import DEFAULT_OPERATOR_IMAGE
from kelastic.operator.nodeloss import DEFAULT_TOLERATION_SECONDS

if TYPE_CHECKING:
    from kelastic.operator.controller import Controller, ControllerOptions
    from kelastic.operator.kube import Kube
    from kelastic.operator.leader import LeaderElector
    from kelastic.operator.netpol import NetworkPolicyConfig

__all__ = ["build_parser", "main"]

LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kelastic-operator",
        description="Run the kelastic ElasticJob operator.",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="namespace to watch (repeatable)"
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (cluster-wide)"
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster credentials, else $KUBECONFIG)")
    p.add_argument("--context", help="kubeconfig context to use")
    p.add_argument("--standalone", action="store_true", help="act without leader election (a single replica)")
    p.add_argument("--lease-name", default="kelastic-operator", help="Lease used for leader election")
    p.add_argument(
        "--lease-namespace",
        default=None,
        help="namespace of the Lease (default: $POD_NAMESPACE, else the first --namespace, else default)",
    )
    p.add_argument(
        "--identity", default=None, help="this replica's name in the Lease (default: hostname-pid)"
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    p.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="json: one JSON object per line"
    )
    p.add_argument(
        "--resync-interval",
        type=float,
        default=60.0,
        help="reconcile every job from the caches at least this often (s); a safety net: changes, deadlines "
        "and the rendezvous store trigger passes themselves",
    )
    p.add_argument(
        "--min-replicas-timeout",
        type=float,
        default=300.0,
        help="fail a job whose running workers stay below minReplicas this long (s); a job can override it "
        "with the annotation kelastic.dev/min-replicas-timeout-seconds",
    )
    p.add_argument(
        "--success-grace",
        type=float,
        default=30.0,
        help="after the first worker succeeds, how long the others get to finish before the job is Succeeded (s)",
    )
    p.add_argument(
        "--agent-python",
        default="python",
        help="interpreter that runs kelastic.agent for non-python training commands",
    )
    p.add_argument(
        "--agent-image",
        default=os.environ.get("KELASTIC_OPERATOR_IMAGE") or DEFAULT_OPERATOR_IMAGE,
        help="image of the init container that injects kelastic-agent into workers (spec.agent: inject); "
        "the operator's own image (default $KELASTIC_OPERATOR_IMAGE, else %(default)s)",
    )
    p.add_argument(
        "--store-image",
        default=None,
        help="image of the rendezvous store pods (default: --agent-image)",
    )
    p.add_argument(
        "--store-resources",
        type=_resources,
        default=None,
        metavar="JSON",
        help='requests and limits of the store container, e.g. \'{"requests": {"cpu": "50m", "memory": '
        '"256Mi"}, "limits": {"memory": "512Mi"}}\' (default: those)',
    )
    p.add_argument(
        "--inject-resources",
        type=_resources,
        default=None,
        metavar="JSON",
        help="requests and limits of the agent-injection init container (default: 10m/32Mi, limits 500m/128Mi)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=DEFAULT_HEALTH_PORT,
        help=f"kelastic-agent --health-port of workers (default {DEFAULT_HEALTH_PORT}); 0 disables health "
        "endpoints (and the readiness probe)",
    )
    p.add_argument(
        "--readiness-probe",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="add a readiness probe on the agent's /readyz to workers (default: none, a worker is ready "
        "while its container runs; every probe that finds the agent still starting is a Warning event)",
    )
    p.add_argument(
        "--node-loss-toleration",
        type=int,
        default=DEFAULT_TOLERATION_SECONDS,
        metavar="SECONDS",
        help="how long worker and store pods stay bound to a node that stopped reporting before the control "
        "plane evicts them and the operator replaces them, unless their template tolerates the "
        "node.kubernetes.io/unreachable and not-ready taints itself (default "
        f"{DEFAULT_TOLERATION_SECONDS}); -1 leaves the API server's default (300)",
    )
    p.add_argument(
        "--coscheduling-scheduler-name",
        default=None,
        metavar="NAME",
        help="schedulerName of the scheduler-plugins coscheduling scheduler: jobs whose workers use it get a "
        "scheduling.x-k8s.io PodGroup (default scheduler-plugins-scheduler; volcano is always recognised)",
    )
    p.add_argument(
        "--kubernetes-gang",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="where the API server serves scheduling.k8s.io/v1beta1 PodGroups (Kubernetes' GenericWorkload "
        "feature), the workers of a job that names no other gang scheduler join one, so kube-scheduler binds "
        "none of them until minReplicas fit (default on; read from discovery at start; docs/operations.md)",
    )
    p.add_argument(
        "--network-policy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="create two NetworkPolicies per job: its workers admit only the job's workers (every port) and "
        "the operator (the health port); its store admits only the job's workers and the operator "
        "(default on; docs/security.md)",
    )
    # The flag of earlier releases, when the policy was off by default and covered the store only.
    p.add_argument(
        "--store-network-policy", dest="network_policy", action="store_true", help=argparse.SUPPRESS
    )
    p.add_argument(
        "--operator-pod-labels",
        default="",
        metavar="K=V,...",
        help="labels of the operator's own pods, which the NetworkPolicies admit from --operator-namespace",
    )
    p.add_argument(
        "--operator-namespace",
        default=os.environ.get("POD_NAMESPACE") or None,
        metavar="NS",
        help="the namespace the operator's pods run in (default $POD_NAMESPACE); the NetworkPolicies admit "
        "the operator's pods from it alone",
    )
    p.add_argument(
        "--key-secret",
        default="kelastic-operator-key",
        metavar="NAME",
        help="the Secret holding the operator's master key, from which every job's secret is derived, in "
        "--operator-namespace (else --lease-namespace, else the first --namespace, else default); created "
        "at start-up when absent",
    )
    p.add_argument(
        "--network-policy-metrics-from",
        default="",
        metavar="JSON",
        help="NetworkPolicyPeers admitted to the agents' health port (/metrics) besides the operator, e.g. "
        '\'[{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]\'',
    )
    p.add_argument(
        "--allow-external-stores",
        action="store_true",
        help="let jobs of the kelastic backend name a rendezvous store of their own (spec.rdzvEndpoint), "
        "which the operator then connects to; refused by default (docs/security.md)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics on this port at /metrics (default 0: not served)",
    )
    p.add_argument(
        "--metrics-address", default="0.0.0.0", help="address the metrics port binds (default %(default)s)"
    )
    p.add_argument(
        "--kueue",
        action="store_true",
        help="jobs labelled kueue.x-k8s.io/queue-name wait for Kueue's admission through Workloads "
        "(needs Kueue's CRDs; docs/kueue.md)",
    )
    p.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    return p


def _resources(text: str) -> dict[str, dict[str, str]]:
    """``{"requests": {...}, "limits": {...}}`` as JSON (a usage error otherwise)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or set(value) - {"requests", "limits"}:
        raise argparse.ArgumentTypeError('expected a JSON object {"requests": {...}, "limits": {...}}')
    if not all(isinstance(v, dict) for v in value.values()):
        raise argparse.ArgumentTypeError('requests and limits must be objects such as {"cpu": "50m"}')
    return {k: {str(n): str(q) for n, q in v.items()} for k, v in value.items()}


def bracketed_url(url: str | None) -> str | None:
    """``http://fd00::1:8080/x`` → ``http://[fd00::1]:8080/x``: a URL made from an IPv6 pod IP."""
    if not url or "://" not in url:
        return url
    scheme, _, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    host, _, port = netloc.rpartition(":")
    if host.count(":") >= 1 and not host.startswith("[") and port.isdigit():
        return f"{scheme}://[{host}]:{port}{slash}{path}"
    return url


def _positive(parser: argparse.ArgumentParser, name: str, value: float) -> None:
    if value <= 0:
        parser.error(f"{name} must be > 0, got {value}")


def _connection_info(cfg: Any) -> Any:
    import kopf

    token = None
    scheme = None
    auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    if auth:
        scheme, _, token = auth.partition(" ") if " " in auth else ("Bearer", "", auth)
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The process's entry point: once the operator has stopped, the process ends within seconds."""
    parser = build_parser()
    args = parser.parse_args(argv)
    operator_labels, metrics_from = _checked(parser, args)

    import kopf

    from kelastic.operator.controller import Controller
    from kelastic.operator.handlers import build_registry
    from kelastic.operator.kube import Kube, load_configuration
    from kelastic.operator.store_client import StoreClient

    log = _configure_logging(args)
    source = args.kubeconfig or os.environ.get("KUBECONFIG") or "in-cluster credentials or ~/.kube/config"
    try:
        if args.kubeconfig and not os.path.isfile(args.kubeconfig):
            raise FileNotFoundError("no such file; pass --kubeconfig PATH of an existing kubeconfig")
        cfg = load_configuration(args.kubeconfig, args.context)
    except Exception as exc:
        print(f"kelastic-operator: cannot load Kubernetes credentials from {source}: {exc}", file=sys.stderr)
        return 2
    kube = Kube(cfg)
    master_key = _master_key(kube, args, log)
    if master_key is None:
        return 2
    options = _controller_options(kube, args, operator_labels, metrics_from, log)
    controller = Controller(kube, StoreClient(master_key=master_key), options)
    if args.metrics_port:
        try:
            bound = controller.metrics.serve(args.metrics_port, args.metrics_address)
        except OSError as exc:
            print(
                f"kelastic-operator: cannot serve metrics on {args.metrics_address}:{args.metrics_port}: {exc}",
                file=sys.stderr,
            )
            return 2
        log.info("serving Prometheus metrics on %s:%d/metrics", args.metrics_address, bound)
    elector = None if args.standalone else _elector(kube, args, controller)
    registry = build_registry(controller, elector, cluster_wide=args.all_namespaces)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        # kopf logs in at start and again after a 401: read the credentials afresh, so a
        # rotated service-account token (in-cluster, or the kubeconfig a kubelet wrote) is used.
        try:
            return _connection_info(load_configuration(args.kubeconfig, args.context))
        except Exception as exc:
            log.warning(
                "could not reload Kubernetes credentials from %s (%s); using those loaded at start",
                source,
                exc,
            )
            return _connection_info(cfg)

    scope = "all namespaces" if args.all_namespaces else ", ".join(args.namespace or ["default"])
    log.info(
        "kelastic-operator starting: watching %s, %s",
        scope,
        "standalone" if elector is None else f"leader election on Lease {elector.namespace}/{elector.name}",
    )
    # Our own loop, not asyncio.run's: that one waits at the end for every thread still
    # blocked in a request to an API server that is gone (up to its timeouts and retries).
    loop = asyncio.new_event_loop()
    try:
        kopf.run(
            loop=loop,
            registry=registry,
            clusterwide=args.all_namespaces,
            namespaces=args.namespace or ([] if args.all_namespaces else ["default"]),
            standalone=True,
            liveness_endpoint=bracketed_url(args.liveness),  # $(POD_IP) may be an IPv6 address
        )
    except KeyboardInterrupt:
        pass
    finally:
        kube.close()
    loop.close()  # lets idle executor threads end, without waiting for busy ones
    _exit_within(2.0, 0, log)
    return 0


def _checked(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[dict[str, str], tuple[dict[str, Any], ...]]:
    """The checks of the flags that argparse cannot make (a usage error, exit 2, names the flag);
    returns the parsed ``--operator-pod-labels`` and ``--network-policy-metrics-from``."""
    _positive(parser, "--resync-interval", args.resync_interval)
    _positive(parser, "--success-grace", args.success_grace)
    if not 0 <= args.health_port < 65536:
        parser.error(f"--health-port must be in 0..65535, got {args.health_port}")
    if not 0 <= args.metrics_port < 65536:
        parser.error(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    from kelastic.operator.netpol import parse_labels, parse_peers

    try:
        operator_labels = parse_labels(args.operator_pod_labels)
    except ValueError as exc:
        parser.error(f"--operator-pod-labels: {exc}")
    if operator_labels and not args.operator_namespace:
        parser.error(
            "--operator-pod-labels needs the operator's namespace: pass --operator-namespace NS or set "
            "$POD_NAMESPACE (the NetworkPolicies admit the operator's pods from that namespace only)"
        )
    try:
        metrics_from = parse_peers(args.network_policy_metrics_from)
    except ValueError as exc:
        parser.error(f"--network-policy-metrics-from: {exc}")
    if args.min_replicas_timeout < 0:
        parser.error(f"--min-replicas-timeout must be >= 0, got {args.min_replicas_timeout}")
    return operator_labels, metrics_from


def _configure_logging(args: argparse.Namespace) -> logging.Logger:
    """kopf's and the root logger's levels from ``--log-level``/``--log-format``; the operator's logger."""
    import kopf

    kopf.configure(
        debug=args.log_level == "debug",
        verbose=args.log_level in ("debug", "info"),
        quiet=args.log_level == "error",
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL,
    )
    logging.getLogger().setLevel(args.log_level.upper())
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    if args.log_level != "debug":
        # kopf reports every handler run at INFO, its liveness endpoint every probe (aiohttp's
        # access log); our own lines say what changed.
        for name in ("kopf.objects", "kopf.activities", "aiohttp.access"):
            logging.getLogger(name).setLevel(logging.WARNING)
    return logging.getLogger("kelastic.operator")


def _controller_options(
    kube: Kube,
    args: argparse.Namespace,
    operator_labels: dict[str, str],
    metrics_from: Any,
    log: logging.Logger,
) -> ControllerOptions:
    """What the controller reconciles with, from the flags (and the API server's discovery)."""
    from kelastic.operator.builders import BuildConfig
    from kelastic.operator.controller import ControllerOptions
    from kelastic.operator.reconcile import ReconcileConfig

    return ControllerOptions(
        resync_interval=args.resync_interval,
        kueue=args.kueue,
        reconcile=ReconcileConfig(
            min_replicas_timeout=args.min_replicas_timeout,
            success_grace=args.success_grace,
            allow_external_stores=args.allow_external_stores,
            network_policy=_network_policy(kube, args, operator_labels, metrics_from, log),
            build=BuildConfig(
                agent_python=args.agent_python,
                agent_image=args.agent_image,
                store_image=args.store_image,
                **({"store_resources": args.store_resources} if args.store_resources else {}),
                **({"inject_resources": args.inject_resources} if args.inject_resources else {}),
                health_port=args.health_port or None,
                readiness_probe=args.readiness_probe,
                node_loss_toleration=None if args.node_loss_toleration < 0 else args.node_loss_toleration,
                **(
                    {"coscheduling_scheduler": args.coscheduling_scheduler_name}
                    if args.coscheduling_scheduler_name
                    else {}
                ),
                kubernetes_gang=args.kubernetes_gang and _kubernetes_gang(kube, log),
            ),
        ),
    )


def _master_key(kube: Kube, args: argparse.Namespace, log: logging.Logger) -> bytes | None:
    """The operator's master key (:mod:`kelastic.operator.masterkey`); None, said on stderr, when it
    can be neither read nor created."""
    from kelastic.operator import masterkey

    namespace = args.operator_namespace or args.lease_namespace or (args.namespace or ["default"])[0]
    try:
        key = masterkey.load_or_create(kube, namespace, args.key_secret)
    except Exception as exc:  # no key, no operator: the message says what it needs
        print(f"kelastic-operator: {exc}", file=sys.stderr)
        return None
    log.info("every job's secret is derived from the master key in Secret %s/%s", namespace, args.key_secret)
    return key


def _elector(kube: Kube, args: argparse.Namespace, controller: Controller) -> LeaderElector:
    """The leader election on the Lease the flags name; only the leader's controller acts."""
    from kelastic.operator.leader import LeaderElector

    lease_ns = args.lease_namespace or os.environ.get("POD_NAMESPACE") or (args.namespace or ["default"])[0]
    identity = args.identity or f"{socket.gethostname()}-{os.getpid()}"
    elector = LeaderElector(
        kube,
        namespace=lease_ns,
        name=args.lease_name,
        identity=identity,
        on_change=controller.on_leadership,
    )
    controller.is_leader = lambda: elector.is_leader
    return elector


def _kubernetes_gang(kube: Kube, log: logging.Logger) -> bool:
    """Whether the API server serves Kubernetes' own PodGroups (discovery, once at start-up)."""
    from kelastic.operator.kube import ApiError
    from kelastic.operator.podgroup import KUBERNETES_API_VERSION

    try:
        served = kube.serves(KUBERNETES_API_VERSION, "podgroups")
    except ApiError as err:
        log.warning(
            "cannot read discovery of %s (%s): jobs get no Kubernetes PodGroup; restart the operator to "
            "try again",
            KUBERNETES_API_VERSION,
            err,
        )
        return False
    if served:
        log.info(
            "the API server serves %s PodGroups: the workers of each job (unless its template names Volcano "
            "or the coscheduling scheduler) join the job's PodGroup, placed all or nothing up to minReplicas",
            KUBERNETES_API_VERSION,
        )
    else:
        log.info(
            "the API server serves no %s PodGroups (Kubernetes' GenericWorkload feature is off): workers are "
            "scheduled one by one unless their template names a gang scheduler",
            KUBERNETES_API_VERSION,
        )
    return served


def _network_policy(
    kube: Kube,
    args: argparse.Namespace,
    operator_labels: dict[str, str],
    metrics_from: tuple[dict[str, Any], ...],
    log: logging.Logger,
) -> NetworkPolicyConfig:
    """The NetworkPolicies' settings; reads the operator's namespace once to learn whether the
    policies can select it by name (``kelastic.operator.netpol.namespace_check``), and logs what they admit."""
    from kelastic.operator.kube import ApiError
    from kelastic.operator.netpol import NetworkPolicyConfig, namespace_check

    namespace = args.operator_namespace if operator_labels else None
    labelled = True
    if not args.network_policy:
        log.info(
            "NetworkPolicies are off (--no-network-policy): any pod of the cluster reaches the jobs' pods"
        )
    elif namespace is None:
        log.info(
            "the NetworkPolicies admit no operator: its pods are not named (--operator-pod-labels with "
            "--operator-namespace), as fits an operator that runs outside the cluster"
        )
    else:
        try:
            found = kube.get_namespace(namespace)
            labels, error = dict((found.get("metadata") or {}).get("labels") or {}), None
        except ApiError as err:
            labels, error = None, str(err)
        labelled, line = namespace_check(namespace, labels, error)
        log.log(logging.INFO if labelled and error is None else logging.WARNING, line)
    return NetworkPolicyConfig(
        enabled=args.network_policy,
        operator_labels=operator_labels,
        operator_namespace=namespace,
        namespace_labelled=labelled,
        metrics_from=metrics_from,
    )


def _exit_within(grace: float, code: int, log: logging.Logger) -> None:
    """Make sure the process ends at most ``grace`` seconds from now, with ``code``.

    Python joins every worker thread at exit; one blocked in a request to an API server
    that is gone would hold a SIGTERM up for the request's timeouts and retries (minutes).
    Called once the cleanup is done, so nothing is lost by not waiting for such requests.
    """

    def force() -> None:
        waiting = sorted(
            t.name
            for t in threading.enumerate()
            if t not in (threading.current_thread(), threading.main_thread()) and not t.daemon
        )
        log.warning(
            "requests to the API server still unanswered after %g s: exiting without them (threads %s)",
            grace,
            ", ".join(waiting) or "none",
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(grace, force)
    timer.daemon = True  # a normal exit does not wait for it; it runs while the exit waits
    timer.start()


if __name__ == "__main__":
    sys.exit(main())
