"""A stranger with store access forges the operator's records, against two real controlled agents.

A real ``kelastic-rendezvous``; two real ``kelastic-agent`` processes on loopback with
``--rdzv-conf controlled=1`` and the job's secret as the operator derives it from its master key
(scripts/ckpt_worker.py saving every step); the operator's bounds and membership published by
the operator's own code path (``StoreClient.publish``, signed with that secret); and the test as
the stranger, a torch ``TCPStore`` client that knows the run id. It writes ``ctl/bounds`` of
min = max = 1, a membership without node-b, and the controller's ``dropped`` fate for node-b
with its counters and event: the agents ignore every one (and say so), keep both members and
save every step; the operator's next publication puts its own bounds back.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import runpy
import secrets
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from kelastic.agent.rendezvous import protocol
from kelastic.agent.rendezvous.protocol import CONTROLLER_DROPPED, ControllerBounds, RunKeys
from kelastic.agent.rendezvous.records import RecordSigner
from kelastic.agent.rendezvous.server import start_server_process
from kelastic.operator import jobsecret
from kelastic.operator.reconcile import PublishMembership
from kelastic.operator.store_client import StoreClient

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))
SCRIPT = Path(__file__).parent / "scripts" / "ckpt_worker.py"
NODES = ("node-a", "node-b")

pytestmark = pytest.mark.slow


def test_a_strangers_bounds_membership_and_dropped_fate_are_ignored_by_controlled_agents(
    tmp_path: Path,
) -> None:
    master = secrets.token_bytes(32)
    run_id = str(uuid.uuid4())  # the job's uid, as the operator names the run
    (tmp_path / "job-secret").write_text(jobsecret.derived_value(master, run_id) + "\n")
    (tmp_path / "job-secret").chmod(0o600)
    shm = Path("/dev/shm") / f"kelastic-ctl-hostile-{uuid.uuid4().hex[:8]}"
    server = start_server_process(harness.loopback_host(), 0, timeout=60)
    cluster = harness.Cluster(tmp_path, server.endpoint, run_id=run_id)
    operator = StoreClient(master_key=master, refresh=0)
    action = PublishMembership(
        "Membership", "", endpoint=server.endpoint, run_id=run_id, nodes=NODES, min_nodes=2, max_nodes=2,
        store_id="s",
    )  # fmt: skip
    try:
        assert asyncio.run(operator.publish(action)), "the operator could not publish to the store"
        for name in NODES:
            cluster.start(
                name,
                ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-conf", "controlled=1",
                 "--checkpoint-dir", str(shm), "--checkpoint-memory", "128Mi"],
                ["--mib", "1", "--step-time", "0.2", "--steps", "100000"],
                script=SCRIPT,
            )  # fmt: skip
        job = SimpleNamespace(out=cluster.out)

        def events() -> list[dict[str, object]]:
            path = job.out / "events.jsonl"
            return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

        def saved() -> list[int]:
            return [int(str(e["step"])) for e in events() if e["event"] == "saved"]

        def restores() -> int:
            return sum(e["event"] == "restored" for e in events())

        cluster.wait_for("3 saves by both members", lambda: len(saved()) >= 3, 180)
        host, _, port = server.endpoint.rpartition(":")
        store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
        keys = RunKeys(run_id)  # the stranger's: no secret, it signs nothing
        r = protocol.read_counter(store, keys.open)
        before, first = restores(), max(saved()) + 1
        store.set(keys.bounds, ControllerBounds(1, 1, 1).to_json())
        store.set(keys.membership, json.dumps({"nodes": ["node-a"], "min_nodes": 1, "max_nodes": 1}))
        store.set(keys.fate(r, "node-b"), CONTROLLER_DROPPED)
        store.add(keys.gone(r), 1)
        store.add(keys.accounted(r), 1)
        protocol.push_event(store, keys, f"dropped {r} node-b")
        protocol.push_event(store, keys, "membership")
        start = max(saved())
        cluster.wait_for("10 more saves", lambda: max(saved(), default=0) >= start + 10, 180)
        last = max(saved())
        assert restores() == before, "the stranger's bounds or fate made the group re-form"
        assert set(range(first, last + 1)) <= set(saved()), sorted(set(saved()))[-30:]
        assert protocol.read_counter(store, keys.open) == r, "a new round was opened"
        assert all(a.proc.poll() is None for a in cluster.agents)
        for a in cluster.agents:
            assert "ignored a store record" in a.output(), a.output()[-2000:]
        # The operator's next publication finds no bounds of its own and writes them again.
        assert asyncio.run(operator.publish(action))
        agent = RunKeys(run_id, RecordSigner.for_job(cluster.secret.read_text().strip().encode()), True)
        assert protocol.read_bounds(store, agent) == ControllerBounds(2, 2, 2)
    finally:
        operator.close()
        cluster.close()
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
