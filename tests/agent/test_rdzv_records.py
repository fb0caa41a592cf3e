"""Signed store records (kelastic.agent.rendezvous.records): what a reader takes, what it ignores."""

from __future__ import annotations

import logging
import secrets

import pytest

from kelastic.agent.rendezvous.records import MARK, RecordSigner, record_key

KEY = secrets.token_hex(32).encode()


def test_a_signed_record_reads_back_and_keeps_its_text_before_the_mark() -> None:
    signer = RecordSigner.for_job(KEY)
    stored = signer.sign("run:r/3/fate/a", "dead|b")
    assert stored.startswith("dead|b") and MARK.decode() in stored
    assert signer.open("run:r/3/fate/a", stored) == b"dead|b"
    assert signer.open("run:r/3/fate/a", stored.encode()) == b"dead|b"
    assert signer.open("run:r/3/fate/a", None) is None and signer.refused == 0


@pytest.mark.parametrize(
    "forge",
    [
        lambda s: "dead|stranger",  # unsigned
        lambda s: s.replace("dead", "left"),  # the value changed under its tag
        lambda s: RecordSigner.for_job(secrets.token_hex(32).encode()).sign("run:r/3/fate/a", "dead|b"),
        lambda s: s + "0",  # a tag too long
        lambda s: b"\xff\xfe" + MARK + b"00",  # not text at all
        lambda s: "",
    ],
)
def test_a_record_that_fails_its_mac_is_ignored_and_counted(forge, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    signer = RecordSigner.for_job(KEY)
    stored = signer.sign("run:r/3/fate/a", "dead|b")
    with caplog.at_level(logging.WARNING):
        assert signer.open("run:r/3/fate/a", forge(stored)) is None
    assert signer.refused == 1
    assert "ignored a store record run:r/3/fate/a" in caplog.text


def test_a_record_moved_to_another_key_round_or_job_fails() -> None:
    signer = RecordSigner.for_job(KEY)
    stored = signer.sign("run:r/3/fate/a", "dead|b")
    assert signer.open("run:r/3/fate/b", stored) is None
    assert signer.open("run:r/4/fate/a", stored) is None
    assert signer.open("other:r/3/fate/a", stored) is None
    round3 = signer.scoped("run round 3")
    assignment = round3.sign("kelastic/assigned_ranks/1", "[0, 2, 0, 2, 0, []]")
    assert round3.open("kelastic/assigned_ranks/1", assignment) is not None
    assert signer.scoped("run round 4").open("kelastic/assigned_ranks/1", assignment) is None
    assert signer.refused == 4  # scoped signers share the count


def test_refusals_are_logged_at_most_once_per_interval_and_counted_in_the_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kelastic.agent.auth import REFUSALS, Reason
    from kelastic.agent.telemetry import refusals

    before = REFUSALS.total("store_record", Reason.UNAUTHENTICATED)
    signer = RecordSigner.for_job(KEY)
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            signer.open("run:ev/1", "closed-job")
    assert signer.refused == 50 and caplog.text.count("ignored a store record") == 1
    assert REFUSALS.total("store_record", Reason.UNAUTHENTICATED) == before + 50
    assert refusals()[(("service", "store_record"), ("reason", "unauthenticated"))] == before + 50


def test_a_record_of_an_earlier_round_counts_only_once_a_later_one_was_taken() -> None:
    """A record bound to a round and read in another is none; it is counted as refused (a
    replay) only when older than one taken from that key, never for a record its writer has
    not written again since the round changed."""
    from kelastic.agent.auth import REFUSALS, Reason

    signer = RecordSigner.for_job(KEY)

    def refused() -> int:
        return REFUSALS.total("store_record", Reason.BAD_REQUEST)

    before = refused()
    signer.other_round("run:progress/b", 1, 2)  # b has not published in round 2 yet
    assert refused() == before and signer.refused == 0
    signer.took("run:progress/b", 2)
    signer.took("run:progress/b", 1)  # an earlier reader's view: the latest stays 2
    signer.other_round("run:progress/b", 1, 2)  # round 1's record after round 2's: a replay
    signer.other_round("run:progress/b", None, 2)  # one of no round, likewise
    signer.other_round("run:progress/c", 1, 2)  # another key: nothing taken from it yet
    assert refused() == before + 2 and signer.refused == 2


def test_without_a_secret_records_are_written_and_read_as_they_are() -> None:
    plain = RecordSigner.for_job(None)
    assert not plain.signing and plain.sign("run:closed", "1") == "1"
    assert plain.open("run:closed", b"anything") == b"anything" and plain.refused == 0


def test_the_records_key_is_not_the_secret_and_depends_on_it() -> None:
    assert record_key(KEY) != KEY and len(record_key(KEY)) == 32
    assert record_key(KEY) != record_key(secrets.token_hex(32).encode())


def test_rank_exchange_takes_only_the_jobs_role_infos_and_assignments() -> None:
    """A stranger's role info (its own checkpoint endpoint) and assignment, written before the
    agents', are ignored: the ring and the ranks are the job's (attack: a ring from the store)."""
    import threading
    import time

    import torch.distributed as dist

    from kelastic.agent.api import RankAssignment, RoleInstanceInfo, exchange_rank_assignments

    store = dist.HashStore()
    signer = RecordSigner.for_job(KEY).scoped("run round 1")
    store.set("kelastic/role_info/1", RoleInstanceInfo("default", 1, 1, 0, "10.6.6.6:1").to_json())
    evil = RankAssignment(0, 1, 0, 1, 0, ("10.6.6.6:1",)).to_json()
    store.set("kelastic/assigned_ranks/1", evil)
    got: dict[int, RankAssignment] = {}

    def agent(rank: int) -> None:
        got[rank] = exchange_rank_assignments(
            store, rank, 2, "default", 1, timeout=30, endpoint=f"127.0.0.1:{rank + 1}", signer=signer
        )

    zero = threading.Thread(target=agent, args=(0,))
    zero.start()
    time.sleep(0.3)  # rank 0 reads the stranger's role info first, and waits for the job's
    agent(1)
    zero.join(30)
    assert got[0].ring == got[1].ring == ("127.0.0.1:1", "127.0.0.1:2")
    assert (got[0].base_global_rank, got[1].base_global_rank, got[1].global_world_size) == (0, 1, 2)
    assert signer.refused >= 2


def test_rank_exchange_without_a_secret_is_torchs() -> None:
    import torch.distributed as dist

    from kelastic.agent.api import exchange_rank_assignments

    store = dist.HashStore()
    one = exchange_rank_assignments(store, 0, 1, "default", 2, timeout=5, endpoint="h:1")
    assert one.ring == ("h:1",) and store.get("kelastic/role_info/0") == b'["default", 0, 2, 0, "h:1"]'


def test_a_round_moves_on_only_by_signed_records_not_by_counters_anyone_may_bump() -> None:
    import torch.distributed as dist

    from kelastic.agent.rendezvous.protocol import Fate, RoundClose, RunKeys, claim_fate, round_moved_on

    store = dist.HashStore()
    keys = RunKeys("run", RecordSigner.for_job(KEY))
    stranger = RunKeys("run")
    store.add(keys.open, 1)  # round 1 closed
    assert not round_moved_on(store, keys, 1, 2, seen=False)
    store.add(keys.open, 1)  # a stranger's: no close of round 2 behind it
    store.set(keys.size(2), RoundClose(2, "x", "t", "10.6.6.6", 1).to_value())
    claim_fate(store, stranger, 1, "a", Fate.DEAD, "stranger")
    assert not round_moved_on(store, keys, 1, 2, seen=False)
    assert round_moved_on(store, RunKeys("run"), 1, 2, seen=False)  # without a secret: as before
    store.set(keys.size(2), keys.sign(keys.size(2), RoundClose(2, "b", "t", "h", 1).to_value()))
    assert round_moved_on(store, keys, 1, 2, seen=False)
