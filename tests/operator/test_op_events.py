"""Events: a repeated cause updates one Event (count, lastTimestamp) instead of creating another."""

from __future__ import annotations

import asyncio
from typing import Any

from kelastic.operator.events import EventRecorder
from kelastic.operator.kube import ApiError, Kube


def event(
    reason: str = "CreateWorker", message: str = "created pod demo-worker-0", uid: str = "u1"
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"namespace": "default"},
        "involvedObject": {"kind": "ElasticJob", "name": "demo", "namespace": "default", "uid": uid},
        "reason": reason,
        "message": message,
        "type": "Normal",
        "source": {"component": "kelastic-operator"},
    }


class FakeApi:
    """Events by name, as an API server keeps them; ``expire`` drops them all (the Event TTL)."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

    async def create(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.01)  # a create in flight while a repeat arrives
        self.calls.append("create")
        name = body["metadata"]["name"]
        assert name not in self.objects
        self.objects[name] = body
        return body

    async def patch(self, ns: str, name: str, patch: dict[str, Any]) -> None:
        self.calls.append("patch")
        if name not in self.objects:
            raise ApiError(404, "NotFound", f'events "{name}" not found')
        self.objects[name] = {**self.objects[name], **patch}


def test_repeats_patch_one_event_and_distinct_causes_get_their_own() -> None:
    api = FakeApi()
    recorder = EventRecorder(api.create, api.patch)

    async def scenario() -> None:
        await asyncio.gather(*(recorder.record(event()) for _ in range(3)))
        await recorder.record(event())
        await recorder.record(event(message="created pod demo-worker-1"))
        await recorder.record(event(uid="u2"))  # a new job of the same name

    asyncio.run(scenario())
    assert api.calls.count("create") == 3 and api.calls.count("patch") == 3
    counts = sorted((o["message"], o["involvedObject"]["uid"], o["count"]) for o in api.objects.values())
    assert counts == [
        ("created pod demo-worker-0", "u1", 4),
        ("created pod demo-worker-0", "u2", 1),
        ("created pod demo-worker-1", "u1", 1),
    ]
    first = next(o for o in api.objects.values() if o["count"] == 4)
    assert first["lastTimestamp"] >= first["firstTimestamp"]


def test_an_expired_event_is_created_again() -> None:
    api = FakeApi()
    recorder = EventRecorder(api.create, api.patch)
    asyncio.run(recorder.record(event()))
    api.objects.clear()
    asyncio.run(recorder.record(event()))
    assert api.calls == ["create", "patch", "create"]
    assert [o["count"] for o in api.objects.values()] == [1]


def test_memory_is_bounded() -> None:
    api = FakeApi()
    recorder = EventRecorder(api.create, api.patch, max_entries=2)

    async def scenario() -> None:
        for i in range(5):
            await recorder.record(event(message=f"m{i}"))

    asyncio.run(scenario())
    assert len(recorder._posted) == 2


def test_against_an_api_server_a_resync_storm_leaves_one_event(kube: Kube) -> None:
    async def scenario() -> EventRecorder:
        recorder = EventRecorder(
            lambda ns, body: asyncio.to_thread(kube.create, ns, "events", body),
            lambda ns, name, patch: asyncio.to_thread(kube.patch, ns, "events", name, patch),
        )
        for _ in range(5):
            await recorder.record(
                event(reason="FailedCreate", message="create pod demo-worker-0 failed: 403")
            )
        return recorder

    recorder = asyncio.run(scenario())
    items = kube.request("GET", "/api/v1/namespaces/default/events")["items"]
    assert [(e["reason"], e["count"]) for e in items] == [("FailedCreate", 5)]
    assert items[0]["lastTimestamp"] >= items[0]["firstTimestamp"]
    assert recorder.stats == {"created": 1, "patched": 4}
