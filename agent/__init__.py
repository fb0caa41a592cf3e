"""kelastic's in-pod elastic agent.

The public API, in layers (each usable on its own):

- :mod:`kelastic.agent.multiprocessing`: ``start_processes`` and the process
  contexts that start, watch, tail and stop a node's local ranks;
- :mod:`kelastic.agent.rendezvous`: the ``kelastic`` rendezvous backend, its store
  server (``kelastic-rendezvous``) and the controller protocol (``control``);
- :mod:`kelastic.agent.api`: ``WorkerSpec`` … ``SimpleElasticAgent``, the agent's
  contract; :class:`LocalElasticAgent` is the concrete agent behind ``kelastic-agent``;
- :mod:`kelastic.agent.progress`: ``update(step, total)`` for training scripts;
- :mod:`kelastic.agent.contract`: the names shared with the operator.

Names are imported on first use, so ``import kelastic.agent.contract`` or
``kelastic.agent.progress`` does not pay for torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ElasticAgent",
    "LocalElasticAgent",
    "MembershipWatcher",
    "RunResult",
    "SimpleElasticAgent",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
]

_HOME = {
    "ElasticAgent": "kelastic.agent.api",
    "MembershipWatcher": "kelastic.agent.api",
    "RunResult": "kelastic.agent.api",
    "SimpleElasticAgent": "kelastic.agent.api",
    "Worker": "kelastic.agent.api",
    "WorkerGroup": "kelastic.agent.api",
    "WorkerSpec": "kelastic.agent.api",
    "WorkerState": "kelastic.agent.api",
    "LocalElasticAgent": "kelastic.agent.local_agent",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
