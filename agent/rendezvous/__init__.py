"""Rendezvous for kelastic agents: the ``kelastic`` backend, its store server and controller protocol.

- ``KelasticRendezvousHandler`` / ``create_handler``: the backend (algorithm in
  ``kelastic.agent.rendezvous.handler``). Importing this package registers it as
  ``kelastic`` in torch's ``rendezvous_handler_registry``, so
  ``get_rendezvous_handler(params)`` serves ``kelastic``, ``c10d`` and ``static``.
- ``RendezvousServer`` / ``start_server_process`` / ``serve_store``: the store
  (``kelastic-rendezvous`` in ``kelastic.agent.rendezvous.server``).
- ``kelastic.agent.rendezvous.control``: what the operator publishes and reads.
"""

from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from . import control, standby
from .handler import BACKEND, KelasticRendezvousHandler, create_handler
from .server import (
    READY_PREFIX,
    RendezvousServer,
    ServedStore,
    ServerProcess,
    serve_store,
    start_server_process,
)
from .settings import RendezvousSettings, default_node_name, settings_from_params

__all__ = [
    "BACKEND",
    "READY_PREFIX",
    "KelasticRendezvousHandler",
    "RendezvousServer",
    "RendezvousSettings",
    "ServedStore",
    "ServerProcess",
    "control",
    "create_handler",
    "default_node_name",
    "get_rendezvous_handler",
    "serve_store",
    "settings_from_params",
    "standby",
    "start_server_process",
]
