"""A data position that survives any resize of the group (``kelastic.data``)."""

from __future__ import annotations

__all__: list[str] = []
