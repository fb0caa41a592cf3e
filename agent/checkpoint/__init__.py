"""Checkpoints at memory speed, kept by the kelastic agent (``kelastic.checkpoint``)."""

from __future__ import annotations

__all__: list[str] = []
