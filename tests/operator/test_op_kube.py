"""The operator's REST client encodes request bodies itself: plain JSON, once."""

from __future__ import annotations

import json
from datetime import date, datetime, timezone

import pytest

from kelastic.operator.kube import encode_body


def test_a_body_is_compact_json_with_times_in_iso_8601() -> None:
    body = {"status": {"at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc), "day": date(2026, 1, 2)}}
    encoded = encode_body(body)
    assert json.loads(encoded) == {"status": {"at": "2026-01-02T03:04:05+00:00", "day": "2026-01-02"}}
    assert b" " not in encoded
    assert encode_body(b'{"already": "encoded"}') == b'{"already": "encoded"}'


def test_a_body_that_is_not_json_is_refused_before_any_request() -> None:
    with pytest.raises(TypeError, match="object is not JSON serializable"):
        encode_body({"x": object()})
