"""The controller's I/O loop with a recording API: watch-driven, no per-job polling."""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from kelastic.agent import contract
from kelastic.operator.clock import SYSTEM, Clock, FakeClock
from kelastic.operator.controller import Controller, ControllerOptions
from kelastic.operator.events import combined_message
from kelastic.operator.kube import ApiError
from kelastic.operator.metrics import RECOVERY_FIELD
from kelastic.operator.observed import PodPhase, PodView, RendezvousView
from kelastic.operator.store_client import StoreClient

KEY = ("ns", "demo")


class RecordingKube:
    """Answers like an API server for what the controller calls, and records every call."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.calls: list[str] = []
        self.event_messages: list[str] = []
        self.fail_status_writes = 0
        self.fail_pod_creates = 0
        #: The Nodes by name; None: reading them is forbidden.
        self.nodes: dict[str, dict[str, Any]] | None = {}
        self._rv = itertools.count(100)

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._rv))
        meta.setdefault("uid", f"uid-{meta.get('name')}")
        return obj

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append("GET job")
        return copy.deepcopy(self.job)

    def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("PATCH job/status")
        if self.fail_status_writes:
            self.fail_status_writes -= 1
            raise ApiError(500, "InternalError", "etcd is having a bad day")
        status = {**(self.job.get("status") or {}), **patch}
        self.job = self._stamp({**self.job, "status": {k: v for k, v in status.items() if v is not None}})
        return copy.deepcopy(self.job)

    def create(self, namespace: str, plural: str, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(f"POST {plural}")
        if plural == "pods" and self.fail_pod_creates:
            self.fail_pod_creates -= 1
            raise ApiError(0, "Unreachable", "the API server did not answer")
        if plural == "events":
            self.event_messages.append(manifest["message"])
        created = self._stamp(manifest)
        if plural == "services":
            created.setdefault("spec", {})["clusterIP"] = "127.2.0.9"
        return created

    def dry_run_create(self, namespace: str, plural: str, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(f"POST {plural} (dry run)")
        return copy.deepcopy(manifest)

    def delete(
        self, namespace: str, plural: str, name: str, uid: str | None = None, grace_seconds: int | None = None
    ) -> None:
        self.calls.append(
            f"DELETE {plural}" + ("" if grace_seconds is None else f" {name} grace {grace_seconds}")
        )

    def get_node(self, name: str) -> dict[str, Any] | None:
        self.calls.append(f"GET node {name}")
        if self.nodes is None:
            raise ApiError(403, "Forbidden", f'nodes "{name}" is forbidden')
        return copy.deepcopy(self.nodes.get(name))

    def patch(self, namespace: str, plural: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(f"PATCH {plural}")
        return {}

    def pod_log(self, *args: Any) -> str:
        self.calls.append("GET pods/log")
        return ""

    def job_calls(self) -> list[str]:
        return [c for c in self.calls if "job" in c]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run(
    loop: asyncio.AbstractEventLoop,
    kube: RecordingKube,
    scenario: Any,
    store: StoreClient | None = None,
    clock: Clock = SYSTEM,
    **options: Any,
) -> Controller:
    controller = Controller(kube, store or StoreClient(), ControllerOptions(**options), clock=clock)  # type: ignore[arg-type]

    async def main() -> None:
        controller.start()
        try:
            await scenario(controller)
        finally:
            await controller.stop()
            controller.store.close()

    loop.run_until_complete(main())
    return controller


async def settle(controller: Controller, seconds: float = 0.3) -> None:
    await asyncio.sleep(seconds)
    while controller.queue.busy or controller._background:
        await asyncio.sleep(0.02)


async def until(what: str, cond: Any, timeout: float = 20.0) -> None:
    """Wait (real time) for ``cond()``: the passes' API calls run in threads, which fake time does not wait for."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_job_is_read_from_the_watch_and_an_idle_job_costs_no_request(
    loop: asyncio.AbstractEventLoop, kit: Any
) -> None:
    kube = RecordingKube(kit.job_body())
    calls_after_start: list[str] = []
    clock = FakeClock()

    async def scenario(controller: Controller) -> None:
        controller.job_seen(KEY, "1", copy.deepcopy(kube.job))
        await settle(controller)
        assert "POST services" in kube.calls and "PATCH job/status" in kube.calls
        calls_after_start.extend(kube.calls)
        await clock.run_for(30.0)  # far longer than the old 1-5 s per-job poll, short of the resync
        await settle(controller)

    controller = run(loop, kube, scenario, clock=clock)
    assert "GET job" not in kube.calls and controller.stats["job_reads"] == 0
    assert kube.calls == calls_after_start, "an idle job made API requests"


def test_the_status_write_answer_is_the_next_pass_input_and_a_late_older_event_is_ignored(
    loop: asyncio.AbstractEventLoop, kit: Any
) -> None:
    kube = RecordingKube(kit.job_body())
    first = copy.deepcopy(kube.job)
    first["metadata"]["resourceVersion"] = "1"

    async def scenario(controller: Controller) -> None:
        controller.job_seen(KEY, "1", first)
        await settle(controller)
        assert controller.cache.body(KEY) == kube.job and kube.job["status"].get("phase")
        controller.job_seen(KEY, "1", first)  # the watch repeating the old state late
        await settle(controller)
        assert controller.cache.body(KEY)["metadata"]["resourceVersion"] != "1"
        assert controller.cache.body(KEY) == kube.job, "the last write's answer is the controller's copy"

    run(loop, kube, scenario)
    assert "GET job" not in kube.calls


def test_a_trigger_before_the_watch_delivered_the_job_reads_it_once(
    loop: asyncio.AbstractEventLoop, kit: Any
) -> None:
    kube = RecordingKube(kit.job_body())

    async def scenario(controller: Controller) -> None:
        controller.trigger(KEY)  # e.g. one of its pods was seen first
        await settle(controller)
        controller.trigger(KEY)
        await settle(controller)

    controller = run(loop, kube, scenario)
    assert kube.job_calls().count("GET job") == 1 and controller.stats["job_reads"] == 1


def test_a_failed_pass_is_retried_with_backoff_without_any_poll(
    loop: asyncio.AbstractEventLoop, kit: Any
) -> None:
    kube = RecordingKube(kit.job_body())
    kube.fail_status_writes = 2
    clock = FakeClock()

    async def scenario(controller: Controller) -> None:
        controller.job_seen(KEY, "1", copy.deepcopy(kube.job))
        await until("the first failure", lambda: controller.queue.failures(KEY) == 1)
        await settle(controller, 0)
        assert kube.job_calls() == ["PATCH job/status"]
        await clock.run_for(0.9)
        await settle(controller, 0)
        assert kube.job_calls() == ["PATCH job/status"], "retried before its back-off"
        await clock.run_for(0.2)  # retried after 1 s
        await until("the second failure", lambda: controller.queue.failures(KEY) == 2)
        assert kube.job_calls().count("PATCH job/status") == 2
        await clock.run_for(2.1)  # then after 2 s: succeeds
        await until("the success", lambda: controller.queue.failures(KEY) == 0)
        assert kube.job_calls().count("PATCH job/status") == 3

    run(loop, kube, scenario, clock=clock)


def test_pods_created_but_not_yet_watched_are_not_created_again_and_one_event_covers_them(
    loop: asyncio.AbstractEventLoop, kit: Any
) -> None:
    kube = RecordingKube(kit.job_body(replicas=3))  # the recording API feeds no watch: the index stays empty

    async def scenario(controller: Controller) -> None:
        controller.job_seen(KEY, "1", copy.deepcopy(kube.job))
        await settle(controller)
        for _ in range(3):  # passes before the watch delivered the new pods (pod events, a resync)
            controller.trigger(KEY)
            await settle(controller, 0.05)

    run(loop, kube, scenario)
    assert kube.calls.count("POST pods") == 4, kube.calls  # the store and 3 workers, once each
    workers = [m for m in kube.event_messages if m.startswith("creating worker")]
    assert workers == ["creating worker pods demo-worker-0, demo-worker-1, demo-worker-2"], workers


def test_combined_event_message() -> None:
    assert combined_message(["creating worker pod a"]) == "creating worker pod a"
    assert combined_message(["creating worker pod a", "creating worker pod b"]) == "creating worker pods a, b"
    assert combined_message(["stopping a", "creating worker pod b"]) == "stopping a; creating worker pod b"
    many = combined_message([f"creating worker pod job-worker-{i}" for i in range(1000)])
    assert len(many) <= 1024 and many.startswith("creating worker pods job-worker-0, job-worker-1,")
    assert many.endswith(" more") and "... and 9" in many


def test_a_failed_create_is_retried_without_waiting_for_the_resync(
    loop: asyncio.AbstractEventLoop, kit: Any
) -> None:
    kube = RecordingKube(kit.job_body(min_r=1, replicas=1))
    kube.fail_pod_creates = 3  # every create of the first pass times out
    clock = FakeClock()

    async def scenario(controller: Controller) -> None:
        controller.job_seen(KEY, "1", copy.deepcopy(kube.job))
        await settle(controller, 0.2)
        failed = [m for m in kube.event_messages if "failed" in m]
        # The creates that failed together share one Event (3 failed creates, fewer Events).
        assert len(failed) < 3 and any(m.count(" failed: ") == 2 for m in failed), kube.event_messages
        attempts = kube.calls.count("POST pods")
        await clock.run_for(1.1)  # retried after 1 s, not after the 60 s resync
        await until("the retried create", lambda: kube.calls.count("POST pods") > attempts)

    run(loop, kube, scenario, clock=clock)


class RecoveredStore(StoreClient):
    """A job's store whose two agents report one recovery, as they do for as long as they run."""

    def __init__(self, view: RendezvousView) -> None:
        super().__init__()
        self.view = view

    async def read(self, endpoint: str, run_id: str) -> RendezvousView | None:
        return self.view

    async def connect(self, endpoint: str) -> bool:
        return True

    async def publish(self, action: Any) -> bool:
        return True


def test_a_recovery_is_counted_once_across_operator_restarts(
    loop: asyncio.AbstractEventLoop, kit: Any
) -> None:
    kube = RecordingKube(kit.job_body(replicas=2, status={"rdzvEndpoint": "127.2.0.9:29400"}))
    store_pod = PodView(
        name="demo-rendezvous",
        uid="uid-store",
        role=contract.ROLE_RENDEZVOUS,
        index=None,
        phase=PodPhase.RUNNING,
        owner_uid="uid-demo",
    )
    ended = time.time() - 30
    view = RendezvousView(
        world_size=2,
        restarts=1,
        members=("demo-worker-0", "demo-worker-1"),
        recoveries=(("demo-worker-0", 2.0, ended), ("demo-worker-1", 2.5, ended + 0.2)),
    )

    def operator(store: RecoveredStore) -> Controller:
        async def scenario(controller: Controller) -> None:
            controller.bind_indexes({KEY: [store_pod]}, {})
            controller.job_seen(KEY, None, copy.deepcopy(kube.job))
            await settle(controller)
            for _ in range(3):  # store reads, resyncs: more passes over the same reports
                controller.trigger(KEY)
                await settle(controller, 0.05)

        return run(loop, kube, scenario, store=store, store_read_interval=0.05)

    def recoveries(controller: Controller) -> float | None:
        return controller.metrics.registry.get_sample_value("kelastic_recovery_seconds_count")

    first = operator(RecoveredStore(view))
    assert recoveries(first) == 1
    assert first.metrics.registry.get_sample_value("kelastic_recovery_seconds_sum") == 2.5
    assert kube.job["status"][RECOVERY_FIELD]
    # A new operator (restarted, or the standby taking over) reads the same reports again.
    assert recoveries(operator(RecoveredStore(view))) == 0
    # It does count the job's next recovery.
    later = replace(view, recoveries=(*view.recoveries, ("demo-worker-0", 4.0, ended + 20)))
    assert recoveries(operator(RecoveredStore(later))) == 1


def test_a_new_job_gets_its_pods_and_one_status_write_that_counts_them(
    loop: asyncio.AbstractEventLoop, kit: Any
) -> None:
    kube = RecordingKube(kit.job_body(replicas=4, min_r=1, max_r=4))

    async def scenario(controller: Controller) -> None:
        controller.job_seen(KEY, "1", copy.deepcopy(kube.job))
        await settle(controller)

    run(loop, kube, scenario)
    # One pass: the Service, then (with its cluster IP) the store and the workers, then the status.
    assert kube.calls.count("POST pods") == 5 and kube.job_calls() == ["PATCH job/status"], kube.calls
    assert kube.job["status"]["replicaStatuses"]["Worker"]["active"] == 4


class UnreachableStore(StoreClient):
    """A job's store that answers nothing, at once (the real client's connects to an address
    nobody serves would run past the test's scenario into the operator's stop)."""

    async def read(self, endpoint: str, run_id: str) -> RendezvousView | None:
        return None

    async def connect(self, endpoint: str) -> bool:
        return False

    async def publish(self, action: Any) -> bool:
        return False


def test_a_pod_the_taint_manager_deleted_is_forced_only_after_its_node_reads_lost(
    loop: asyncio.AbstractEventLoop, kit: Any
) -> None:
    """The controller reads the Node of a pod the taint manager deleted, and only that one; the
    pod is force-deleted when the node is NotReady, not when it is Ready or cannot be read."""
    body = kit.job_body(replicas=2, status={"phase": "Running", "rdzvEndpoint": "127.2.0.9:29400"})
    pods = [
        kit.store(node="n1"),
        kit.worker(0, node="n1"),
        kit.worker(1, terminating=True, disruption="DeletionByTaintManager", node="n2"),
    ]
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    lost = {"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}

    def calls(nodes: dict[str, dict[str, Any]] | None) -> list[str]:
        kube = RecordingKube(copy.deepcopy(body))
        kube.nodes = nodes

        async def scenario(controller: Controller) -> None:
            controller.bind_indexes({KEY: pods}, {KEY: [kit.service()]})
            controller.job_seen(KEY, None, copy.deepcopy(kube.job))
            await settle(controller)

        run(loop, kube, scenario, store=UnreachableStore())
        return kube.calls

    forced = "DELETE pods demo-worker-1 grace 0"
    done = calls({"n1": ready, "n2": lost})
    assert forced in done and [c for c in done if c.startswith("GET node")] == ["GET node n2"], done
    assert forced not in calls({"n1": ready, "n2": ready})
    assert forced not in calls(None)  # forbidden: the pod waits for its node, said in the log
