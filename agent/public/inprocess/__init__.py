"""``kelastic.inprocess``: training that outlives a re-form in the same process.

The short name training scripts import; the implementation is :mod:`kelastic.agent.inprocess`
(it ships with the agent, so a worker of an injected agent imports it from a torch-only
image too).
"""

from kelastic.agent.inprocess import *  # noqa: F403
from kelastic.agent.inprocess import __all__ as __all__
