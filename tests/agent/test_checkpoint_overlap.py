"""OverlappingSaver against a real checkpoint service (real socket, real tmpfs files, real DCP),
in one process: the save's copy is held at a chosen point by a planner of the test's, so what
the saver says and what a reader sees while a copy is in flight are checked, not raced.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from kelastic.agent.checkpoint import overlap
from kelastic.agent.checkpoint.errors import CheckpointTooLarge, NotInKelasticWorker
from kelastic.agent.checkpoint.overlap import snapshot
from kelastic.agent.checkpoint.service import CheckpointService
from kelastic.agent.checkpoint.settings import CheckpointSettings
from kelastic.agent.checkpoint.storage import _LocalInfo
from kelastic.agent.contract import ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_ENDPOINT
from kelastic.checkpoint import MemoryReader, MemoryWriter, OverlappingSaver

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[CheckpointService]:
    """One node's checkpoint service on a real tmpfs, and this process as its worker."""
    root = Path("/dev/shm") / f"kelastic-test-{uuid.uuid4().hex[:8]}"
    service = CheckpointService(
        CheckpointSettings(root=root, node="node-a", limit=64 * 2**20),
        host="127.0.0.1",
        advertise="127.0.0.1",
    ).start()
    for k, v in service.worker_env().items():
        monkeypatch.setenv(k, v)
    yield service
    service.stop(remove=True)
    shutil.rmtree(root, ignore_errors=True)


class HeldPlanner(DefaultSavePlanner):
    """Holds the save's copy when it reaches its second tensor until ``release`` is set
    (``reached`` says it got there): resolve_data runs for every item before the copy."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Event()
        self.release = threading.Event()
        self._tensors = 0

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if write_item.type != WriteItemType.BYTE_IO:
            self._tensors += 1
            if self._tensors == 2:
                self.reached.set()
                assert self.release.wait(30), "the test never released the held save"
        return data


def model(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 64, generator=g),
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
        "step": torch.tensor(seed),
        "meta": {"seed": seed, "names": ["a", "b"]},
    }


def restored() -> dict[str, Any] | None:
    reader = MemoryReader()
    if not reader.exists():
        return None
    target = model(999)
    dcp.load(target, storage_reader=reader, no_dist=True)
    return target


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        torch.equal(v, b[k]) and v.dtype == b[k].dtype if isinstance(v, torch.Tensor) else v == b[k]
        for k, v in a.items()
    )


def test_outside_a_kelastic_worker_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CHECKPOINT_ENDPOINT, raising=False)
    monkeypatch.delenv(ENV_CHECKPOINT_DIR, raising=False)
    with pytest.raises(NotInKelasticWorker, match="kelastic-agent"):
        OverlappingSaver()


def test_a_save_returns_before_its_copy_and_commits_only_after_it(agent: CheckpointService) -> None:
    first, second = model(1), model(2)
    with OverlappingSaver() as saver:
        assert saver.save(first, step=1) is None  # nothing before it
        assert saver.wait() == 1
        assert same(restored() or {}, first)

        planner = HeldPlanner()
        saver.save(second, step=2, planner=planner)  # returns although the copy is held
        assert planner.reached.wait(10)
        assert saver.pending and not saver.staged
        staged = threading.Event()
        waiter = threading.Thread(target=lambda: (saver.wait_staged(), staged.set()))
        waiter.start()
        assert not staged.wait(0.5), "wait_staged() returned while the copy was still held"
        assert same(restored() or {}, first), "a reader saw the save in flight, not the previous one"

        planner.release.set()
        assert staged.wait(10)
        waiter.join()
        assert saver.wait() == 2
        assert not saver.pending and saver.staged
        got = restored()
        assert got is not None and same(got, second)
        assert MemoryReader().choice is not None and MemoryReader().choice.step == 2  # type: ignore[union-attr]


def test_what_is_not_a_tensor_is_saved_as_it_was_when_save_returned(agent: CheckpointService) -> None:
    class Position:  # a Stateful: its state_dict() is taken inside save()
        def __init__(self) -> None:
            self.at = 7

        def state_dict(self) -> dict[str, Any]:
            return {"at": self.at}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.at = sd["at"]

    state = model(3)
    position = Position()
    planner = HeldPlanner()
    with OverlappingSaver() as saver:
        saver.save({**state, "position": position}, step=3, planner=planner)
        assert planner.reached.wait(10)
        state["meta"]["names"].append("changed after save()")  # the caller's objects move on
        position.at = 8
        planner.release.set()
    target, loaded = {**model(999), "position": Position()}, model(3)
    target["position"].at = -1
    dcp.load(target, storage_reader=MemoryReader(), no_dist=True)
    assert target["meta"] == loaded["meta"] and target["position"].at == 7


def test_a_failed_save_raises_on_the_training_thread_and_the_previous_one_stands(
    agent: CheckpointService,
) -> None:
    huge = {"huge": torch.zeros(40 * 2**20 // 4)}  # 40 MiB: with a replica's room, over 64 MiB
    lenient = OverlappingSaver()
    small = model(4)
    lenient.save(small, step=4)
    assert lenient.save(huge, step=5) == 4
    assert lenient.close() is None, "a save skipped as too large is not a committed one"
    saver = OverlappingSaver(strict=True)
    saver.save(huge, step=5)
    saver.wait_staged()  # returns: a failed save reads nothing any more
    with pytest.raises(CheckpointException) as raised:  # what dcp.save would raise
        saver.wait()
    assert CheckpointTooLarge.__name__ in str(raised.value) and "limit is 64.0 MiB" in str(raised.value)
    assert same(restored() or {}, small)
    saver.close()
    with pytest.raises(RuntimeError, match="after close"):
        saver.save(small, step=6)


def test_an_exception_out_of_the_block_does_not_wait_for_the_save_in_flight(agent: CheckpointService) -> None:
    planner, saver = HeldPlanner(), OverlappingSaver()
    left: list[BaseException] = []

    def train() -> None:
        try:
            with saver:
                saver.save(model(1), step=1, planner=planner)
                assert planner.reached.wait(10)
                raise KeyError("the group broke")  # as a collective over a lost peer would
        except KeyError as e:
            left.append(e)

    trainer = threading.Thread(target=train)
    trainer.start()
    trainer.join(30)  # the save stays held until released below: waiting for it would not end
    assert not trainer.is_alive() and left, "leaving the block by an exception waited for the held save"
    with pytest.raises(RuntimeError, match="after close"):
        saver.save(model(2), step=2)
    planner.release.set()  # the abandoned save goes on by itself, and its thread ends
    saver._thread.join(30)
    assert not saver._thread.is_alive()


def test_snapshot_copies_containers_and_values_and_keeps_tensors() -> None:
    t = torch.ones(3)
    value = {"t": t, "l": [t, {"x": [1, 2]}], "tup": (t, "s")}
    copied = snapshot(value)
    assert copied["t"] is t and copied["l"][0] is t and copied["tup"][0] is t
    assert copied["l"][1] == {"x": [1, 2]} and copied["l"][1]["x"] is not value["l"][1]["x"]


def test_a_save_that_finds_the_previous_replica_still_going_is_skipped_not_waited_for(
    agent: CheckpointService, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(overlap, "PROGRESS_EVERY", 0.2)
    first = model(1)
    with OverlappingSaver() as saver:
        saver.save(first, step=1)
        assert saver.wait() == 1
        agent.keeper.outgoing(1)  # step 1's replica is still being sent to the peer
        try:
            for step in (2, 3, 4):
                saver.save(model(step), step=step)
                assert saver.wait() is None, f"step {step} was saved while the replica was still going"
                time.sleep(0.15)
            assert saver.skipped == 3
            assert same(restored() or {}, first)
            told = capsys.readouterr().err
            assert "no checkpoint for" in told and "replica" in told, told
            assert "not saved" not in told, "a skip by request printed as a refusal"
        finally:
            agent.keeper.outgoing(-1)
        saver.save(model(5), step=5)
        assert saver.wait() == 5
        assert same(restored() or {}, model(5))


def test_a_saver_that_waits_for_the_replica_saves_once_it_is_in_place(agent: CheckpointService) -> None:
    with OverlappingSaver(skip_if_busy=False) as saver:
        saver.save(model(1), step=1)
        assert saver.wait() == 1
        agent.keeper.outgoing(1)
        saver.save(model(2), step=2)
        time.sleep(0.5)
        assert saver.pending, "the save did not wait for the replica in flight"
        agent.keeper.outgoing(-1)
        assert saver.wait() == 2 and saver.skipped == 0


def _plan(refused: str | None, busy: bool) -> SavePlan:
    return SavePlan([], storage_data=_LocalInfo("127.0.0.1:1", "n", 3, refused, busy))


@pytest.mark.parametrize(
    ("locals_", "refused", "busy"),
    [
        ([(None, False), (None, False)], None, False),
        ([(None, False), ("rank 1: waited 0 s: replica", True)], "rank 1: waited 0 s: replica", True),
        (
            [("rank 0: waited 0 s: replica", True), ("rank 1: needs 9 GiB", False)],
            "rank 1: needs 9 GiB",
            False,
        ),
    ],
)
def test_one_busy_node_skips_the_save_on_every_rank_and_too_large_is_never_hidden_as_busy(
    agent: CheckpointService, locals_: list[tuple[str | None, bool]], refused: str | None, busy: bool
) -> None:
    writer = MemoryWriter(skip_if_busy=True)
    plans = writer.prepare_global_plan([_plan(r, b) for r, b in locals_])
    infos = [p.storage_data for p in plans]
    assert {(i.refused, i.busy) for i in infos} == {(refused, busy)}
    assert len({i.id for i in infos}) == 1
