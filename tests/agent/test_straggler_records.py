"""The records behind a straggler swap are signed: a stranger with access to the store gets no
member swapped out (kelastic.agent.straggler_watch against a real kelastic-rendezvous).

Three members a, b, c of a closed round publish signed goodput records of equal work. The
stranger writes a goodput record of its own for b (nine times the work) and a straggler
verdict naming b with ``replace``, unsigned and under another key, and writes back a verdict
the job did sign but has since taken back. The leader names nobody, b never steps aside, and
each forged record is counted; the job's own verdict does make b step aside (the control).
A member's own signed report of an earlier round, written back in the next, is none either.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch.distributed as dist

from kelastic.agent.rendezvous import ServerProcess, control, protocol
from kelastic.agent.rendezvous.records import RecordSigner
from kelastic.agent.straggler import Policy, StragglerRule
from kelastic.agent.straggler_watch import StragglerWatch

KEY = b"0123456789abcdef" * 4
RULE = StragglerRule(policy=Policy.REPLACE, ratio=1.5, window=0.0)
MEMBERS = ["a", "b", "c"]


def signed_round(server: ServerProcess, run_id: str) -> tuple[dist.Store, RecordSigner]:
    """Round 1 closed with a, b, c, and each member's signed goodput record (equal work)."""
    store = control.connect(server.endpoint, timeout=10)
    signer = RecordSigner.for_job(KEY)
    keys = protocol.RunKeys(run_id, signer)
    close = protocol.RoundClose(3, "a", "t", "h", 1).to_value()
    store.set(keys.size(1), keys.sign(keys.size(1), close))
    protocol.mark_closed(store, keys, 1)
    store.set(keys.members(1), keys.sign(keys.members(1), json.dumps(MEMBERS)))
    for name in MEMBERS:
        publish_goodput(store, run_id, name, 1.0, signer)
    return store, signer


def publish_goodput(store: dist.Store, run_id: str, node: str, work: float, signer: Any, r: int = 1) -> None:
    record = {"time": time.time(), "step": 10, "work_seconds": work}
    control.publish_progress(
        store, run_id, node, step=10, total=None, restarts=0, goodput=record, signer=signer, round_=r
    )


def watch(server: ServerProcess, run_id: str, node: str) -> StragglerWatch:
    return StragglerWatch(server.endpoint, run_id, node, RULE, period=0.0, job_key=KEY)


def verdict(node: str | None, made: float) -> dict[str, object]:
    return {
        "node": node,
        "round": 1,
        "ratio": 9.0,
        "since": made,
        "policy": "Replace",
        "action": "replace",
        "time": made,
    }


def test_a_strangers_goodput_record_makes_no_straggler(server: ServerProcess, run_id: str) -> None:
    store, signer = signed_round(server, run_id)
    leader = watch(server, run_id, "a")
    refused = signer.refused
    for forger in (None, RecordSigner.for_job(b"another job's secret, 32 bytes!")):
        publish_goodput(store, run_id, "b", 9.0, forger)
        for _ in range(3):
            assert leader.tick(leader=True, round_=1) is None
        assert leader.verdict is None, leader.verdict
    assert leader._signer.refused > refused
    # the control: b's own record, as slow, makes it the straggler
    publish_goodput(store, run_id, "b", 9.0, signer)
    leader.tick(leader=True, round_=1)
    assert leader.verdict is not None and leader.verdict["node"] == "b", leader.verdict


def test_a_strangers_verdict_gets_no_member_swapped_out(server: ServerProcess, run_id: str) -> None:
    store, signer = signed_round(server, run_id)
    b = watch(server, run_id, "b")
    stranger = RecordSigner.for_job(b"another job's secret, 32 bytes!")
    for forger in (None, stranger):
        control.publish_straggler(store, run_id, verdict("b", time.time() + 1000), forger)
        for _ in range(3):
            assert b.tick(leader=False, round_=1) is None, "a stranger's verdict swapped b out"
        assert b.verdict is None
    # the job's verdict, taken back: written back by the stranger, it is not taken again
    named = verdict("b", time.time())
    control.publish_straggler(store, run_id, verdict(None, time.time() + 1), signer)
    assert b.tick(leader=False, round_=1) is None
    control.publish_straggler(store, run_id, named, signer)  # an old signed record, replayed
    for _ in range(3):
        assert b.tick(leader=False, round_=1) is None, "a verdict written back swapped b out"
    # the control: the job's own, newer verdict does make b step aside
    control.publish_straggler(store, run_id, verdict("b", time.time() + 2), signer)
    reason = b.tick(leader=False, round_=1)
    assert reason is not None and "b is a straggler" in reason, reason


def test_a_report_of_an_earlier_round_written_back_counts_as_none(server: ServerProcess, run_id: str) -> None:
    """The stranger keeps the bytes of b's signed report of round 1 (nine times the others'
    work) and writes them back once the group re-formed as round 2 and b published its own
    report there. The MAC holds, but the report names round 1: the leader takes it for no
    report (b is no straggler), counts it refused (``store_record``, ``bad_request``), and the
    operator's view of the run shows no figures of it; b's report of round 2 is taken."""
    from kelastic.agent.auth import REFUSALS, Reason

    store, signer = signed_round(server, run_id)
    keys = protocol.RunKeys(run_id, signer)
    publish_goodput(store, run_id, "b", 9.0, signer)  # round 1: slow
    captured = store.get(keys.progress("b"))  # as anyone who reaches the store reads it
    close = protocol.RoundClose(3, "a", "t", "h", 1).to_value()
    store.set(keys.size(2), keys.sign(keys.size(2), close))
    protocol.mark_closed(store, keys, 2)
    store.set(keys.members(2), keys.sign(keys.members(2), json.dumps(MEMBERS)))
    for name in MEMBERS:
        publish_goodput(store, run_id, name, 1.0, signer, r=2)
    leader = watch(server, run_id, "a")
    assert leader.tick(leader=True, round_=2) is None and leader.verdict is None  # the control
    assert control.read_progress(store, run_id, "b", signer, 2) is not None
    before = REFUSALS.total("store_record", Reason.BAD_REQUEST)
    store.set(keys.progress("b"), captured)  # written back: the job's own bytes, valid MAC
    assert control.read_progress(store, run_id, "b", signer, 1) is not None, "not the job's own bytes"
    for _ in range(3):
        assert leader.tick(leader=True, round_=2) is None
    assert leader.verdict is None, leader.verdict
    status = control.read_status(store, run_id, signer)
    assert status.round == 2 and [node for node, _ in status.goodputs] == ["a", "c"], status.goodputs
    assert REFUSALS.total("store_record", Reason.BAD_REQUEST) > before
