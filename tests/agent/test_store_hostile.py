"""A stranger with access to the rendezvous store, against two real agents that save every step.

A real ``kelastic-rendezvous``, two real ``kelastic-agent`` processes on loopback sharing a
job secret (scripts/ckpt_worker.py saving every step to the memory checkpoint), and the
test as the stranger: a torch ``TCPStore`` client that knows the run id (the job's uid, which
anyone who can list the job reads) and writes whatever keys it likes. The records the
agents act on are signed with the job's key (docs/security.md): the stranger's claims of
fates, its closed-job events, its rank assignments and its ring are ignored; the job keeps
saving every step, re-forms only for a real loss, and never talks to the stranger.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import runpy
import shutil
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from kelastic.agent.api import RankAssignment, RoleInstanceInfo
from kelastic.agent.rendezvous import protocol
from kelastic.agent.rendezvous.protocol import JOB_CLOSED_EVENT, Fate, RoundClose, RunKeys
from kelastic.agent.rendezvous.records import RecordSigner
from kelastic.agent.rendezvous.server import ServerProcess, start_server_process
from kelastic.agent.secret import read_secret_file

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))
SCRIPT = Path(__file__).parent / "scripts" / "ckpt_worker.py"
NODES = ("node-a", "node-b")

pytestmark = pytest.mark.slow


@dataclass
class Job:
    cluster: Any
    store: ServerProcess
    run_id: str
    shm: Path

    def events(self) -> list[dict[str, Any]]:
        path = self.cluster.out / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def saved(self) -> list[int]:
        return [e["step"] for e in self.events() if e["event"] == "saved"]

    def restores(self) -> int:
        return sum(e["event"] == "restored" for e in self.events())

    def saves_go_on(self, more: int, timeout: float = 180) -> None:
        start = max(self.saved(), default=0)
        self.cluster.wait_for(
            f"{more} more saves after step {start}",
            lambda: max(self.saved(), default=0) >= start + more,
            timeout,
        )

    def stranger(self) -> dist.TCPStore:
        """A client of the job's store, as anyone who can reach it makes one."""
        host, _, port = self.store.endpoint.rpartition(":")
        return dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    tmp = tmp_path_factory.mktemp("store-hostile")
    shm = Path("/dev/shm") / f"kelastic-store-hostile-{uuid.uuid4().hex[:8]}"
    store = start_server_process(harness.loopback_host(), 29400, timeout=60)
    run_id = f"store-hostile-{uuid.uuid4().hex[:6]}"
    c = harness.Cluster(tmp, store.endpoint, run_id=run_id)
    try:
        for name in NODES:
            c.start(
                name,
                ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "9",
                 "--checkpoint-dir", str(shm), "--checkpoint-memory", "128Mi",
                 # the straggler watch runs (a verdict naming a member swaps it out), but
                 # judges no real member a straggler
                 "--stragglers", "policy=Replace,ratio=50,window=3600"],
                ["--mib", "2", "--step-time", "0.2", "--steps", "100000"],
                script=SCRIPT,
            )  # fmt: skip
        j = Job(c, store, run_id, shm)
        c.wait_for("3 saves", lambda: len(j.saved()) >= 3, 180)
        yield j
    finally:
        c.close()
        store.stop()
        shutil.rmtree(shm, ignore_errors=True)


def current_round(store: dist.TCPStore, keys: RunKeys) -> int:
    return protocol.read_counter(store, keys.open)


def every_step_saved(steps: list[int], first: int, last: int) -> bool:
    return set(range(first, last + 1)) <= set(steps)


@contextlib.contextmanager
def _attacking(attack: Callable[[int], None], every: float = 0.3) -> Iterator[list[int]]:
    """Run ``attack(n)`` (n: the passes before it) on a thread every ``every`` s while the block
    runs; yields a list whose one item counts the passes made."""
    stop, passes = threading.Event(), [0]

    def run() -> None:
        while not stop.is_set():
            attack(passes[0])
            passes[0] += 1
            stop.wait(every)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield passes
    finally:
        stop.set()
        thread.join(10)


def test_fate_claims_and_closed_events_every_half_second_do_not_stall_the_job(job: Job) -> None:
    """The stall attack: every half second the stranger claims a fate for each member (each
    kind, the controller's too), pushes a closed-job event and a round's close naming its own
    worker store, and marks the job closed. The job keeps saving every step, never re-forms."""
    store, keys = job.stranger(), RunKeys(job.run_id)
    restores, first = job.restores(), max(job.saved()) + 1
    kinds = [Fate.REJOIN, Fate.DEAD, Fate.LEFT, Fate.DROPPED]

    def attack(n: int) -> None:
        r = current_round(store, keys)
        for name in NODES:
            kind = kinds[n % len(kinds)]
            claimer = "controller" if kind is Fate.DROPPED else "stranger"
            store.delete_key(keys.fate(r, name))  # a fresh claim each time
            protocol.claim_fate(store, keys, r, name, kind, claimer)
        protocol.push_event(store, keys, JOB_CLOSED_EVENT)
        protocol.push_event(store, keys, protocol.close_event(r + 1, RoundClose(2, "x", "t", "10.6.6.6", 1)))
        store.set(keys.closed, "1")

    with _attacking(attack, every=0.5) as attacks:
        job.saves_go_on(20)
    last = max(job.saved())
    assert attacks[0] >= 5, attacks
    assert job.restores() == restores, "the stranger's claims made the group re-form"
    assert every_step_saved(job.saved(), first, last), (first, last, sorted(set(job.saved()))[-30:])
    assert all(a.proc.poll() is None for a in job.cluster.agents), "an agent took the job for closed"
    for a in job.cluster.agents:
        assert "ignored a store record" in a.output(), a.output()[-2000:]
    store.delete_key(keys.closed)


def test_a_strangers_ring_and_ranks_are_ignored_and_a_real_loss_still_re_forms(job: Job) -> None:
    """The ring attack: before the next round, the stranger writes every agent's role info and
    rank assignment there with its own endpoint on the ring, and the round's close and rank 0's
    join record naming its own worker store. A worker then dies: the agents
    still see the loss (after the closed-job events above), re-form, take only their own
    records, restore from memory and save on; nothing ever connects to the stranger."""
    store, keys = job.stranger(), RunKeys(job.run_id)
    with _strangers_endpoint() as (evil_port, accepted):
        evil = f"127.0.0.1:{evil_port}"
        r = current_round(store, keys)
        for later in range(r + 1, r + 6):
            # the round closed before it did, and rank 0's record, both naming its own worker store
            store.set(keys.size(later), RoundClose(2, "x", "t", "127.0.0.1", evil_port).to_value())
            store.set(
                keys.node(later, 0), json.dumps({"name": "x", "addr": "127.0.0.1", "wstore": evil_port})
            )
            prefix = keys.agent_prefix(later) + "/kelastic/"
            for rank in range(2):
                store.set(
                    f"{prefix}role_info/{rank}", RoleInstanceInfo("default", rank, 1, 0, evil).to_json()
                )
                store.set(
                    f"{prefix}assigned_ranks/{rank}", RankAssignment(0, 1, 0, 1, 0, (evil, evil)).to_json()
                )
        _a_worker_dies_and_the_job_restores(job)
    assert accepted == [], "an agent connected to the stranger's endpoint"


@contextlib.contextmanager
def _strangers_endpoint() -> Iterator[tuple[int, list[socket.socket]]]:
    """A port of the stranger's own on 127.0.0.1 (for the records it forges), and the list of
    the connections made to it, accepted on a thread until the block ends: an agent that
    connects there trusted a forged record."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _a_worker_dies_and_the_job_restores(job: Job) -> None:
    """SIGKILL node-b's worker; return once the agents restored from memory with both nodes
    and the job saves on."""
    restores = job.restores()
    victim = job.cluster.agents[1]
    workers = [p for p in _children(victim.proc.pid) if b"ckpt_worker.py" in _cmdline(p)]
    assert workers, "no worker of node-b found"
    os.kill(workers[0], signal.SIGKILL)
    job.cluster.wait_for("a restore", lambda: job.restores() > restores, 180)
    job.saves_go_on(5)
    restored = [e for e in job.events() if e["event"] == "restored"][-1]
    assert restored["source"] == "memory" and restored["world"] == 2, restored


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_keys_a_stranger_deletes_or_overwrites_cost_no_step(job: Job) -> None:
    """Every third of a second the stranger deletes or overwrites what the agents keep in the
    store while they train: the heartbeats (deleted, text), the round's rank assignments and
    role infos, its fates, the latest events and the closed mark. The agents notice nothing
    worth a re-form, keep saving every step, and the store's bounds hold its garbage."""
    store, keys = job.stranger(), RunKeys(job.run_id)
    restores, first = job.restores(), max(job.saved()) + 1

    def attack(_: int) -> None:
        r = current_round(store, keys)
        store.delete_key(keys.heartbeat(NODES[0]))
        store.set(keys.heartbeat(NODES[1]), "not a number")
        for rank in range(2):
            for what in ("role_info", "assigned_ranks"):
                store.delete_key(f"{keys.agent_prefix(r)}/kelastic/{what}/{rank}")
        for name in NODES:
            store.set(keys.fate(r, name), "dead|stranger")
        latest = protocol.read_counter(store, keys.events)
        store.delete_key(keys.event(latest))
        store.set(keys.event(latest + 1), "garbage \xff")
        store.delete_key(keys.closed)

    with _attacking(attack) as rounds:
        job.saves_go_on(15)
    assert rounds[0] >= 5, rounds
    assert job.restores() == restores, "the stranger's deletes made the group re-form"
    assert every_step_saved(job.saved(), first, max(job.saved()))
    assert all(a.proc.poll() is None for a in job.cluster.agents)


def test_counters_and_member_records_a_stranger_moves_steer_no_re_form(job: Job) -> None:
    """Every third of a second the stranger adds to ``open`` and writes the rounds' member
    lists, the members' slots and standby records; once, it adds to the count of joiners of
    the coming round. The job keeps saving every step without a re-form; then a worker dies:
    the agents re-form (one round more for the count), restore from memory with both nodes,
    and save on. (Heartbeats overwritten this often hide the node's own beats, as deleting
    them would: docs/security.md; the unit tests show that no value of theirs keeps a dead
    node alive.)"""
    store, keys = job.stranger(), RunKeys(job.run_id)
    restores, first = job.restores(), max(job.saved()) + 1
    r = current_round(store, keys)
    store.delete_key(keys.node(r + 1, 0))  # an earlier test's record for that round
    store.add(keys.joined(r + 1), 1)  # a slot of the coming round that nobody holds

    def attack(_: int) -> None:
        store.add(keys.open, 1)
        for i, name in enumerate(NODES):
            store.set(keys.slot(r + i, name), "0")
            store.set(keys.standby(name), json.dumps({"round": r + 1, "since": 0}))
        store.set(keys.members(r), json.dumps(["stranger-1", "stranger-2"]))

    with _attacking(attack) as rounds:
        job.saves_go_on(10)
        assert job.restores() == restores, "the stranger's counters made the group re-form"
        assert every_step_saved(job.saved(), first, max(job.saved()))
        _a_worker_dies_and_the_job_restores(job)
    assert rounds[0] >= 5, rounds
    assert all(a.proc.poll() is None for a in job.cluster.agents)


def test_a_strangers_slot_and_record_in_the_coming_round_cost_one_round_not_the_job(job: Job) -> None:
    """The stranger adds to the coming round's count of joiners and writes a join record of
    its own in the slot that add leaves (slot 0: it would be rank 0, with its own worker
    store). A worker then dies: the agents see a slot whose record the job did not sign,
    close that round empty, form the next one without it, restore from memory with both
    nodes and save on; nobody exits, nothing connects to the stranger, each says what it
    ignored."""
    store, keys = job.stranger(), RunKeys(job.run_id)
    with _strangers_endpoint() as (evil_port, accepted):
        r = current_round(store, keys)
        for later in (r + 1, r + 2):
            store.delete_key(keys.node(later, 0))  # an earlier test's record for that round
        assert store.add(keys.joined(r + 1), 1) == 1, "the coming round had joiners already"
        forged = {"name": "stranger", "addr": "127.0.0.1", "link": evil_port, "wstore": evil_port}
        store.set(keys.node(r + 1, 0), json.dumps(forged))
        _a_worker_dies_and_the_job_restores(job)
    outputs = "\n".join(a.output()[-3000:] for a in job.cluster.agents)
    assert all(a.proc.poll() is None for a in job.cluster.agents), outputs
    assert accepted == [], "an agent connected to the stranger's endpoint"
    assert "ignored a store record" in outputs, outputs


def test_a_running_rounds_records_a_stranger_deletes_or_overwrites_cost_no_step(job: Job) -> None:
    """Every third of a second the stranger deletes or overwrites the records of the round the
    agents run in: its close, the latest-round mark, its member list, the members' join
    records and slots. The running group needs none of them again: it keeps saving every
    step without a re-form; then a worker dies, and the agents still re-form and restore from
    memory with both nodes."""
    store, keys = job.stranger(), RunKeys(job.run_id)
    restores, first = job.restores(), max(job.saved()) + 1
    r = current_round(store, keys)

    def attack(n: int) -> None:
        for key in (keys.size(r), keys.latest, keys.members(r), keys.node(r, 0), keys.node(r, 1)):
            if n % 2 == 1:
                store.set(key, "garbage")
            else:
                store.delete_key(key)
        for name in NODES:
            store.delete_key(keys.slot(r, name))

    with _attacking(attack) as rounds:
        job.saves_go_on(10)
        assert job.restores() == restores, "the stranger's deletes made the group re-form"
        assert every_step_saved(job.saved(), first, max(job.saved()))
        _a_worker_dies_and_the_job_restores(job)
    outputs = "\n".join(a.output()[-3000:] for a in job.cluster.agents)
    assert rounds[0] >= 5, rounds
    assert all(a.proc.poll() is None for a in job.cluster.agents), outputs


def _kill_a_worker(job: Job) -> None:
    victim = job.cluster.agents[1]
    workers = [p for p in _children(victim.proc.pid) if b"ckpt_worker.py" in _cmdline(p)]
    assert workers, "no worker of node-b found"
    os.kill(workers[0], signal.SIGKILL)


def test_a_running_rounds_close_and_latest_mark_deleted_before_a_re_join_send_nobody_back(job: Job) -> None:
    """The stranger deletes the running round's close and the latest-round mark right before
    its members re-join (a worker dies), after a round that closed full (so the store's open
    round, which is then the running one, has no place for a node that is no member of the
    round before it). The members know their round closed: they join the round after it,
    re-form with both nodes and restore from memory, rather than park for a round that will
    not close again."""
    store, keys = job.stranger(), RunKeys(job.run_id)
    restores = job.restores()
    # A round that follows a full one: an ordinary re-form first.
    _kill_a_worker(job)
    job.cluster.wait_for("a restore", lambda: job.restores() > restores, 180)
    job.saves_go_on(3)
    # the running round as the job sees it (the agents' secret: an earlier test moved ``open``)
    signed = RunKeys(job.run_id, RecordSigner.for_job(read_secret_file(job.cluster.secret)))
    r = protocol.open_round(store, signed) - 1
    assert protocol.read_size(store, signed, r - 1) == 2, "the round before the running one was not full"
    restores = job.restores()
    for key in (keys.size(r), keys.latest):
        assert store.delete_key(key), f"{key} was not there to delete"
    _kill_a_worker(job)
    job.cluster.wait_for("a restore after the deletes", lambda: job.restores() > restores, 120)
    job.saves_go_on(3)
    outputs = "\n".join(a.output()[-3000:] for a in job.cluster.agents)
    assert all(a.proc.poll() is None for a in job.cluster.agents), outputs
    assert "is a standby" not in outputs, outputs
    assert protocol.read_size(store, signed, r + 1) == 2, "the members formed no round after theirs"
    restored = [e for e in job.events() if e["event"] == "restored"][-1]
    assert restored["source"] == "memory" and restored["world"] == 2, restored


def test_a_strangers_straggler_verdict_gets_no_member_swapped_out(job: Job) -> None:
    """Every half second the stranger writes the group's straggler verdict naming node-b with
    ``replace`` in the running round (unsigned, then with a MAC of its own), as rank 0's
    agent would. node-b never steps aside: the job keeps saving every step without a
    re-form, and both agents say they ignored the stranger's records."""
    store, keys = job.stranger(), RunKeys(job.run_id)
    restores, first = job.restores(), max(job.saved()) + 1

    def attack(n: int) -> None:
        verdict = {"node": NODES[1], "round": current_round(store, keys), "ratio": 9.0,
                   "since": 0.0, "declared": 0.0, "policy": "Replace", "action": "replace",
                   "time": 4e9}  # fmt: skip
        value = json.dumps(verdict)
        store.set(keys.straggler(), value if n % 2 == 0 else value + "\x1fkmac1:" + "0" * 32)

    try:
        with _attacking(attack, every=0.5) as written:
            job.saves_go_on(15)
    finally:
        store.delete_key(keys.straggler())
    outputs = "\n".join(a.output()[-4000:] for a in job.cluster.agents)
    assert written[0] >= 5, written
    assert job.restores() == restores, "the stranger's verdict made the group re-form"
    assert every_step_saved(job.saved(), first, max(job.saved()))
    assert "steps aside" not in outputs and "is a straggler" not in outputs, outputs
    # (which record an agent's log names is rate-limited: an earlier test's may come first)
    assert f"ignored a store record {job.run_id}:" in outputs, outputs
    assert all(a.proc.poll() is None for a in job.cluster.agents), outputs
