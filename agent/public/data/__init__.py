"""``kelastic.data``: a data position that survives any resize of the group.

The short name training scripts import; the implementation is :mod:`kelastic.agent.data`
(it ships with the agent, so a worker of an injected agent imports it from a torch-only
image too).
"""

from kelastic.agent.data import *  # noqa: F403
from kelastic.agent.data import __all__ as __all__
