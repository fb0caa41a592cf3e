"""When the process kubelet replaces a projected service-account token (80 % of its life, at most 24 h)."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from kelastic.localcluster.kubelet.satokens import IssuedToken, issued_token, refresh_due, write_atomically

T0 = 1_800_000_000.0


def token(seconds: int, issued: float = T0) -> IssuedToken:
    return IssuedToken("kube-api-access", "token", "tok", seconds, issued + seconds)


def test_a_token_is_refreshed_once_80_percent_of_its_life_has_passed() -> None:
    ten_minutes = token(600)  # the shortest lifetime an API server grants
    assert ten_minutes.issued_at == T0 and ten_minutes.refresh_at == T0 + 480
    assert not refresh_due(ten_minutes, T0)
    assert not refresh_due(ten_minutes, T0 + 479.9)
    assert refresh_due(ten_minutes, T0 + 480)
    assert refresh_due(ten_minutes, T0 + 700)  # expired meanwhile (a suspended machine): at once


def test_a_long_lived_token_is_refreshed_after_a_day() -> None:
    week = token(7 * 24 * 3600)
    assert week.refresh_at == T0 + 24 * 3600
    assert not refresh_due(week, T0 + 24 * 3600 - 1) and refresh_due(week, T0 + 24 * 3600)


def test_the_lifetime_is_what_the_api_server_granted() -> None:
    expires = dt.datetime.fromtimestamp(T0 + 3607, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    answer = {"spec": {"expirationSeconds": 3607}, "status": {"token": "abc", "expirationTimestamp": expires}}
    issued = issued_token("vol", "token", answer, requested_s=600, now=T0 - 5)
    assert (issued.token, issued.expiration_seconds, issued.issued_at) == ("abc", 3607, T0)
    # An answer without an expiration: the requested lifetime from now.
    bare = issued_token("vol", "token", {"status": {"token": "x"}}, requested_s=600, now=T0)
    assert bare.expires_at == T0 + 600 and bare.refresh_at == T0 + 480


def test_files_are_replaced_in_one_step(tmp_path: Path) -> None:
    target = tmp_path / "token"
    target.write_text("old")
    inode = target.stat().st_ino
    write_atomically(target, "new", 0o644)
    assert target.read_text() == "new" and target.stat().st_ino != inode  # a new file renamed over
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    assert os.listdir(tmp_path) == ["token"]  # no temporary file left
