"""The store sync: a pass never waits for a store; a new round triggers a pass, progress alone is paced
(on a fake clock: the reads that must not happen are counted over fake seconds, not waited for)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent import contract
from kelastic.operator.checkpoint import CheckpointReport, Restore, Source
from kelastic.operator.clock import FakeClock
from kelastic.operator.observed import PodPhase, PodView, RendezvousView
from kelastic.operator.spec import parse_job
from kelastic.operator.store_client import StoreClient
from kelastic.operator.storesync import StoreSync

KEY = ("ns", "demo")
STORE_POD = PodView(
    name="demo-rendezvous", uid="s", role=contract.ROLE_RENDEZVOUS, index=None, phase=PodPhase.RUNNING
)


class ScriptedStore(StoreClient):
    """Answers each read with the next view of a script (the last one again once it ends)."""

    def __init__(self, views: list[RendezvousView | None]) -> None:
        super().__init__()
        self.views = views
        self.reads = 0

    async def read(self, endpoint: str, run_id: str) -> RendezvousView | None:
        view = self.views[min(self.reads, len(self.views) - 1)]
        self.reads += 1
        return view


def _sync(
    store: StoreClient, calls: list[tuple[str, float]], leader: list[bool], clock: FakeClock
) -> tuple[StoreSync, set[Any]]:
    tasks: set[Any] = set()

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    sync = StoreSync(
        store,
        trigger=lambda key: calls.append(("trigger", 0.0)),
        requeue=lambda key, delay: calls.append(("requeue", delay)),
        known=lambda key: True,
        spawn=spawn,
        is_leader=lambda: leader[0],
        read_interval=0.05,
        progress_interval=5.0,
        clock=clock,
    )
    return sync, tasks


def test_a_new_round_triggers_a_pass_and_progress_alone_waits_for_the_interval(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body(status={"rdzvEndpoint": "127.2.0.9:29400"}))
    round1 = RendezvousView(world_size=2, restarts=0, members=("a", "b"), step=10, total=100)
    views: list[RendezvousView | None] = [
        round1,
        RendezvousView(world_size=2, restarts=0, members=("a", "b"), step=20, total=100),  # progress only
        RendezvousView(world_size=3, restarts=1, members=("a", "b", "c"), step=20, total=100),  # new round
    ]
    store = ScriptedStore(views)
    calls: list[tuple[str, float]] = []
    leader = [True]

    async def scenario() -> None:
        clock = FakeClock()
        sync, tasks = _sync(store, calls, leader, clock)
        sync.pass_started(KEY)
        assert sync.observe(KEY, job, [STORE_POD]) is None  # not read yet: the pass does not wait
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert calls == [("trigger", 0.0)] and sync.observe(KEY, job, [STORE_POD]) == round1
        poller = asyncio.get_running_loop().create_task(sync.poll())
        await clock.run_for(0.99)  # 19 polls: the progress, the new round, then the unchanged store
        assert store.reads == 20
        poller.cancel()
        await asyncio.gather(poller, *tasks, return_exceptions=True)

    asyncio.run(scenario())
    # the progress (read at 0.05 s): after the last pass (at 0) + 5 s; the new round: at once; then nothing
    assert calls == [("trigger", 0.0), ("requeue", pytest.approx(4.95)), ("trigger", 0.0)]


def test_no_store_is_read_for_a_job_without_a_running_store_or_by_a_standby(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body(status={"rdzvEndpoint": "127.2.0.9:29400"}))
    store = ScriptedStore([RendezvousView(world_size=1, restarts=0)])
    calls: list[tuple[str, float]] = []
    leader = [False]

    async def scenario() -> None:
        clock = FakeClock()
        sync, tasks = _sync(store, calls, leader, clock)
        pending = PodView(
            name="demo-rendezvous", uid="s", role=contract.ROLE_RENDEZVOUS, index=None, phase=PodPhase.PENDING
        )
        assert sync.observe(KEY, job, [pending]) is None
        poller = asyncio.get_running_loop().create_task(sync.poll())
        await clock.run_for(1.0)
        assert store.reads == 0  # the store pod does not run yet
        sync.observe(KEY, job, [STORE_POD])
        await asyncio.gather(*tasks)
        assert store.reads == 1  # read once for the pass, in the background
        await clock.run_for(1.0)
        assert store.reads == 1  # a standby does not poll
        leader[0] = True
        await clock.run_for(0.05)
        assert store.reads == 2  # the leader does, every read_interval
        sync.forget(KEY, None)
        await clock.run_for(1.0)
        assert store.reads == 2  # forgotten: no more reads
        poller.cancel()
        await asyncio.gather(poller, *tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_checkpoint_restore_triggers_a_pass_and_a_new_checkpoint_alone_waits(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body(status={"rdzvEndpoint": "127.2.0.9:29400"}))
    base = {"world_size": 2, "restarts": 0, "members": ("a", "b"), "step": 10, "total": 100}
    restore = Restore(4, Source.REPLICA, 0.4, 1_700_000_000.0)
    views: list[RendezvousView | None] = [
        RendezvousView(**base, checkpoints=(CheckpointReport("a", 4),)),
        RendezvousView(**base, checkpoints=(CheckpointReport("a", 5),)),  # a new checkpoint only
        RendezvousView(**base, checkpoints=(CheckpointReport("a", 5, None, restore),)),  # a restore
    ]
    store = ScriptedStore(views)
    calls: list[tuple[str, float]] = []

    async def scenario() -> None:
        clock = FakeClock()
        sync, tasks = _sync(store, calls, [True], clock)
        sync.pass_started(KEY)
        sync.observe(KEY, job, [STORE_POD])
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        poller = asyncio.get_running_loop().create_task(sync.poll())
        await clock.run_for(0.99)  # the new checkpoint, the restore, then the unchanged store
        poller.cancel()
        await asyncio.gather(poller, *tasks, return_exceptions=True)

    asyncio.run(scenario())
    # the first read; the new checkpoint (read at 0.05 s), paced like progress; the restore: at once
    assert calls == [("trigger", 0.0), ("requeue", pytest.approx(4.95)), ("trigger", 0.0)]


def test_a_finished_job_gets_one_last_read_and_a_pass_when_it_changed_the_figures(
    kit: SimpleNamespace,
) -> None:
    """The agents publish their workers' last steps as they end; the job may turn Succeeded
    before the periodic read sees them: one last read, and a pass that writes them."""
    running = parse_job(kit.job_body(status={"phase": "Running", "rdzvEndpoint": "127.2.0.9:29400"}))
    done = parse_job(kit.job_body(status={"phase": "Succeeded", "rdzvEndpoint": "127.2.0.9:29400"}))
    before = RendezvousView(world_size=3, restarts=0, members=("a", "b", "c"), step=292, total=300, round=1)
    final = RendezvousView(world_size=3, restarts=0, members=("a", "b", "c"), step=300, total=300, round=1)
    store = ScriptedStore([before, final])
    calls: list[tuple[str, float]] = []

    async def scenario() -> None:
        clock = FakeClock()
        sync, tasks = _sync(store, calls, [True], clock)
        sync.observe(KEY, running, [STORE_POD])
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert sync.observe(KEY, done, []) == before  # the pass that sees it finished: last figures
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert calls[-1] == ("trigger", 0.0)  # the final read changed the progress: a pass now
        assert sync.observe(KEY, done, []) == final
        poller = asyncio.get_running_loop().create_task(sync.poll())
        await clock.run_for(1.0)
        assert store.reads == 2  # and no periodic reads of a finished job's store
        poller.cancel()
        await asyncio.gather(poller, *tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_new_round_with_the_same_members_triggers_a_pass(kit: SimpleNamespace) -> None:
    """A deleted pod comes back under its name: same members, a new round, a restart to count."""
    job = parse_job(kit.job_body(status={"rdzvEndpoint": "127.2.0.9:29400"}))
    first = RendezvousView(world_size=2, restarts=0, members=("a", "b"), round=1)
    store = ScriptedStore([first, RendezvousView(world_size=2, restarts=0, members=("a", "b"), round=2)])
    calls: list[tuple[str, float]] = []

    async def scenario() -> None:
        clock = FakeClock()
        sync, tasks = _sync(store, calls, [True], clock)
        sync.observe(KEY, job, [STORE_POD])
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        poller = asyncio.get_running_loop().create_task(sync.poll())
        await clock.run_for(0.2)
        assert store.reads >= 2
        poller.cancel()
        await asyncio.gather(poller, *tasks, return_exceptions=True)

    asyncio.run(scenario())
    assert calls[:2] == [("trigger", 0.0), ("trigger", 0.0)], calls


def test_a_succeeded_worker_gets_its_jobs_store_read_at_once(kit: SimpleNamespace) -> None:
    """The job may finish, and its store go, before the next periodic read: the first
    succeeded worker makes the sync read at once, and new progress alone triggers a pass."""
    job = parse_job(kit.job_body(status={"phase": "Running", "rdzvEndpoint": "127.2.0.9:29400"}))
    before = RendezvousView(world_size=2, restarts=0, members=("a", "b"), step=292, total=300, round=1)
    final = RendezvousView(world_size=2, restarts=0, members=("a", "b"), step=300, total=300, round=1)
    store = ScriptedStore([before, final])
    calls: list[tuple[str, float]] = []
    done = PodView(
        name="demo-worker-0", uid="w0", role=contract.ROLE_WORKER, index=0, phase=PodPhase.SUCCEEDED
    )

    async def scenario() -> None:
        clock = FakeClock()
        sync, tasks = _sync(store, calls, [True], clock)
        sync.observe(KEY, job, [STORE_POD])
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert sync.observe(KEY, job, [STORE_POD, done]) == before
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert store.reads == 2 and calls[-1] == ("trigger", 0.0)
        assert sync.observe(KEY, job, [STORE_POD, done]) == final
        await asyncio.sleep(0)
        assert store.reads == 2  # once per job

    asyncio.run(scenario())
