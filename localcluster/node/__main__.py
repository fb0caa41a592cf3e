"""``python -m kelastic.localcluster.node``: see :mod:`kelastic.localcluster.node.up`."""

import sys

from .up import main

sys.exit(main())
