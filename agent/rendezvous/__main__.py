"""``python -m kelastic.agent.rendezvous`` is ``kelastic-rendezvous``."""

import sys

from kelastic.agent.rendezvous.server import main

sys.exit(main())
