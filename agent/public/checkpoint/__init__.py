"""``kelastic.checkpoint``: checkpoints at memory speed, kept by the kelastic agent.

The short name training scripts import; the implementation is
:mod:`kelastic.agent.checkpoint` (it ships with the agent, so a worker of an injected
agent imports it from a torch-only image too).
"""

from kelastic.agent.checkpoint import *  # noqa: F403
from kelastic.agent.checkpoint import __all__ as __all__
