"""``python -m kelastic.operator`` is ``kelastic-operator``."""

import sys

from kelastic.operator.cli import main

sys.exit(main())
