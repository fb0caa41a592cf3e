"""``python -m kelastic.localcluster.apiserver``: the API server emulator alone (debugging, benchmarks)."""

from __future__ import annotations

from .apiserver import main

if __name__ == "__main__":
    raise SystemExit(main())
