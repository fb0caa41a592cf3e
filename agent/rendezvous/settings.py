"""Settings of the kelastic rendezvous, parsed from torch's ``RendezvousParameters``.

``--rdzv-conf`` keys (all optional; seconds may be fractional):

==========================  =======  ===========================================================
key                         default  meaning
==========================  =======  ===========================================================
join_timeout                600      deadline for ``next_rendezvous`` (includes reaching the store)
last_call_timeout           2        first round: wait this long for more nodes once min is reached
rejoin_timeout              10       later rounds: wait this long for members of the previous round
                                     that are neither back nor known dead (normally never needed)
controller_timeout          30       controlled rounds: close with the joined nodes after this long
                                     if a listed node never joins
keep_alive_interval         1        heartbeat period
keep_alive_max_attempt      5        a node whose heartbeat did not move for interval * attempts
                                     is dead (5 s by default, noticed within about 6 s)
node_name                   none     this node's name (default: $KELASTIC_NODE_NAME or host_pid)
local_world_size            none     ranks on this node, shown by ``control.read_status`` (agents set it)
standby                     0        1: this node is a standby: it never grows the group, it waits
                                     without a rank and takes only the place of a lost member
                                     (``kelastic-agent --standby``; see ``standby``)
controlled                  0        1: a controller (kelastic's operator) publishes this
                                     rendezvous' membership and size bounds: the node takes no
                                     slot, claims no place and judges no round's size before they
                                     are in the store (``--nnodes`` is then never acted on)
==========================  =======  ===========================================================

Other keys (torchrun passes some of its own) are ignored.

Why the heartbeat is this slow: a node whose process dies (crash, OOM kill,
deleted pod) is caught within milliseconds by its watcher's TCP link (see
:mod:`kelastic.agent.rendezvous.handler`), so the heartbeat only has to catch what
closes no socket: a frozen process or a lost machine. A shorter timeout would
declare live nodes dead on a real cluster, where a CPU-throttled pod, a
garbage-collection pause or a kube-proxy/conntrack hiccup can stall a heartbeat
for a second or two; each false "dead" costs the whole job a restart.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from torch.distributed.elastic.rendezvous import RendezvousParameters

from kelastic.agent.contract import (
    DEFAULT_RDZV_PORT,
    ENV_INSECURE_NO_SECRET,
    ENV_JOB_SECRET_FILE,
    ENV_NODE_NAME,
    RDZV_CONF_CONTROLLED,
)
from kelastic.agent.secret import INSECURE_KEY, read_secret_file, truthy

from .protocol import ControllerBounds, TimerKind, parse_endpoint

__all__ = [
    "DEFAULT_KEEP_ALIVE_INTERVAL",
    "DEFAULT_KEEP_ALIVE_MAX_ATTEMPT",
    "RendezvousSettings",
    "default_node_name",
    "settings_from_params",
]

DEFAULT_KEEP_ALIVE_INTERVAL = 1.0
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 5


@dataclass(frozen=True)
class RendezvousSettings:
    run_id: str
    host: str
    port: int
    node_name: str
    local_addr: str | None
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 2.0
    rejoin_timeout: float = 10.0
    controller_timeout: float = 30.0
    keep_alive_interval: float = DEFAULT_KEEP_ALIVE_INTERVAL
    keep_alive_max_attempt: int = DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
    local_world_size: int | None = None
    standby: bool = False
    #: A controller publishes the membership (rdzv-conf ``controlled=1``): see :meth:`bounds`.
    controlled: bool = False
    #: The job's key for the peer link (None: no peer link, the heartbeat alone finds deaths).
    job_key: bytes | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def node_timeout(self) -> float:
        """A heartbeat that did not move for this long means the node is dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    def bounds(self, controller: ControllerBounds | None) -> tuple[int, int] | None:
        """The (min, max) nodes this node acts on, given the controller's bounds read from the store.

        The controller's when it published them; else this node's own (``--nnodes``),
        unless the node is ``controlled``: then None, the bounds are not known yet (a new
        store, or one restarted, before the controller's next publication), and the node
        takes no slot, claims no place and closes or re-forms no round by its own
        ``--nnodes``, whose maximum may be above what the controller wants (an operator's
        ``replicas`` below ``maxReplicas``, the pods past it standbys).
        """
        if controller is not None:
            return controller.min_nodes, controller.max_nodes
        return None if self.controlled else (self.min_nodes, self.max_nodes)

    def timer(self, kind: TimerKind) -> float:
        return {
            TimerKind.LAST_CALL: self.last_call_timeout,
            TimerKind.REJOIN: self.rejoin_timeout,
            TimerKind.CONTROLLER: self.controller_timeout,
        }[kind]


_BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def default_node_name() -> str:
    """``$KELASTIC_NODE_NAME`` if set, else ``<hostname>_<pid>``."""
    return os.environ.get(ENV_NODE_NAME) or f"{socket.gethostname()}_{os.getpid()}"


def _seconds(params: RendezvousParameters, key: str, default: float, *, allow_zero: bool = False) -> float:
    raw = params.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv-conf {key}={raw!r} is not a number of seconds") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"rdzv-conf {key}={raw!r} must be {'>= 0' if allow_zero else '> 0'} seconds")
    return value


def _boolean(params: RendezvousParameters, key: str) -> bool:
    raw = str(params.get(key) or "0").strip().lower()
    if raw not in _BOOLEANS:
        raise ValueError(f"rdzv-conf {key}={raw!r} must be one of {', '.join(sorted(_BOOLEANS))}")
    return _BOOLEANS[raw]


def _job_key(params: RendezvousParameters) -> bytes | None:
    """The peer link's key: rdzv-conf ``job_secret_file`` (the agent passes its own), else
    ``$KELASTIC_JOB_SECRET_FILE``; ``insecure_no_secret`` (or its variable) for the public key."""
    path = params.get("job_secret_file") or os.environ.get(ENV_JOB_SECRET_FILE)
    if path:
        return read_secret_file(str(path), flag="rdzv-conf job_secret_file")
    if truthy(str(params.get("insecure_no_secret") or "")) or truthy(os.environ.get(ENV_INSECURE_NO_SECRET)):
        return INSECURE_KEY
    return None


def settings_from_params(params: RendezvousParameters) -> RendezvousSettings:
    """Validate ``params`` for the kelastic backend; ValueError says what is wrong."""
    if not params.run_id:
        raise ValueError("the rendezvous id is empty; pass --rdzv-id (the operator uses the job's UID)")
    host, port = parse_endpoint(params.endpoint or "", DEFAULT_RDZV_PORT)
    attempts_raw = params.get("keep_alive_max_attempt")
    try:
        attempts = DEFAULT_KEEP_ALIVE_MAX_ATTEMPT if attempts_raw in (None, "") else int(attempts_raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv-conf keep_alive_max_attempt={attempts_raw!r} is not an integer") from None
    if attempts < 1:
        raise ValueError(f"rdzv-conf keep_alive_max_attempt={attempts} must be >= 1")
    name = str(params.get("node_name") or default_node_name())
    lws_raw = params.get("local_world_size")
    try:
        lws = None if lws_raw in (None, "") else int(lws_raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv-conf local_world_size={lws_raw!r} is not an integer") from None
    return RendezvousSettings(
        run_id=str(params.run_id),
        host=host,
        port=port,
        node_name=name,
        local_addr=params.local_addr,
        min_nodes=int(params.min_nodes),
        max_nodes=int(params.max_nodes),
        join_timeout=_seconds(params, "join_timeout", 600.0),
        last_call_timeout=_seconds(params, "last_call_timeout", 2.0, allow_zero=True),
        rejoin_timeout=_seconds(params, "rejoin_timeout", 10.0, allow_zero=True),
        controller_timeout=_seconds(params, "controller_timeout", 30.0, allow_zero=True),
        keep_alive_interval=_seconds(params, "keep_alive_interval", DEFAULT_KEEP_ALIVE_INTERVAL),
        keep_alive_max_attempt=attempts,
        local_world_size=lws,
        standby=_boolean(params, "standby"),
        controlled=_boolean(params, RDZV_CONF_CONTROLLED),
        job_key=_job_key(params),
    )
