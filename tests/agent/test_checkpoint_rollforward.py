"""kelastic.checkpoint.restore's roll-forward: the decision (pure), the held step
(kelastic.inprocess.updating), and real gloo groups that copy a live state."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kelastic.agent import inprocess
from kelastic.agent.checkpoint.rollforward import RollForward, plan_roll_forward

RANKS = Path(__file__).parent / "scripts" / "rollforward_ranks.py"


# the decision -----------------------------------------------------------------------------------


def test_the_ranks_holding_the_newest_step_send_to_every_other_rank_in_turn() -> None:
    plan = plan_roll_forward([7, None, 7, 6, None], ["s"] * 5, 5, True)
    assert plan == RollForward(7, ((0, 1), (2, 3), (0, 4)))


def test_every_rank_holding_the_newest_step_copies_nothing() -> None:
    assert plan_roll_forward([4, 4, 4], ["s"] * 3, 4, True) == RollForward(4, ())


def test_no_checkpoint_at_all_still_rolls_forward() -> None:
    assert plan_roll_forward([None, 3], ["s", "s"], None, False) == RollForward(3, ((1, 0),))


@pytest.mark.parametrize(
    ("held", "shapes", "newest", "checkpoint"),
    [
        ([None, None], ["s", "s"], 4, True),  # nobody holds a step: the checkpoint
        ([5, None], ["s", "t"], 4, True),  # states of different shapes
        ([3, 3], ["s", "s"], 4, True),  # a checkpoint newer than every held step
        ([3, None], ["s", "s"], None, True),  # a checkpoint of unknown step
    ],
)
def test_the_checkpoint_is_restored_when_a_live_state_cannot_be_trusted(
    held: list[int | None], shapes: list[str], newest: int | None, checkpoint: bool
) -> None:
    assert plan_roll_forward(held, shapes, newest, checkpoint) is None


# the held step ----------------------------------------------------------------------------------


def test_a_process_holds_the_step_of_the_last_update_that_ended_normally() -> None:
    with inprocess.updating(3):
        assert inprocess.held_step() is None  # halfway: no state to vouch for
    assert inprocess.held_step() == 3
    with pytest.raises(ZeroDivisionError), inprocess.updating(4):
        _ = 1 / 0
    assert inprocess.held_step() is None
    inprocess._hold(None)


def test_a_reform_asked_during_an_update_is_raised_when_it_ends(tmp_path: Path, monkeypatch: Any) -> None:
    asked: list[str] = []

    class Session:
        in_fn = True

        class request:  # the attribute check() reads
            gen = 2

        def reform_asked(self) -> bool:
            asked.append("looked")
            return True

    monkeypatch.setattr(inprocess, "_session", Session())
    with pytest.raises(inprocess.Reform), inprocess.updating(9):
        inprocess.check()  # what the signal handler calls: nothing is raised halfway
        asked.append("updated")
    assert asked == ["updated", "looked"]
    assert inprocess.held_step() == 9  # the update finished before the Reform
    inprocess._hold(None)


# real groups ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(tmp_path: Path, held: list[str], *extra: str) -> list[dict[str, Any]]:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANKS), str(r), str(len(held)), str(port), str(tmp_path), h, *extra]
        )
        for r, h in enumerate(held)
    ]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * len(held)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(held))]


@pytest.mark.slow
def test_ranks_without_the_newest_state_receive_it_from_those_that_hold_it(tmp_path: Path) -> None:
    # rank 0 was lost (a replacement holds nothing), rank 2 missed the last update
    ranks = _group(tmp_path, ["-", "8", "7", "8"])
    for r in ranks:
        assert r["source"] == "live" and r["step"] == 8 and r["held"] == 8, r
        assert r["w"] == [8.0] and r["value"] == 8, r
        assert r["t"] == [8.0, 9.0, 10.0, 64 * 32 - 1 + 8.0], r  # the non-contiguous view, in place
        assert r["history"] == [[8, 8], "after 8"], r
        assert r["counter"][:2] == [[4.0, 4.0, 4.0], "counted 8"], r
    assert [r["counter"][2] for r in ranks] == [1, 0, 1, 0]  # load_state_dict: the receivers only
    assert [r["received"] > 0 for r in ranks] == [True, False, True, False]


@pytest.mark.slow
def test_ranks_whose_states_differ_in_shape_all_restore_the_checkpoint_instead(tmp_path: Path) -> None:
    # Outside a kelastic worker the checkpoint cannot be read: every rank says so, none copied.
    ranks = _group(tmp_path, ["5", "-"], "--odd-shape")
    assert {r.get("error") for r in ranks} == {"NotInKelasticWorker"}, ranks
