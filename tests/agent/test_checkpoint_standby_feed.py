"""A hot standby's copies: the keeper keeps the newest whole set of copies, a node's service
sends its parts to its standbys after each commit, and a part dropped while it is sent
leaves the standby nothing (real services on loopback, real tmpfs folders)."""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kelastic.agent.checkpoint.client import ServiceClient
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.keeper import CheckpointKeeper
from kelastic.agent.checkpoint.plan import StandbyHolder
from kelastic.agent.checkpoint.service import CheckpointService
from kelastic.agent.checkpoint.settings import CheckpointSettings
from kelastic.agent.checkpoint.standbyfeed import _left_out
from kelastic.agent.checkpoint.standbys import StandbyBoard
from kelastic.agent.rendezvous.server import ServerProcess
from kelastic.agent.secret import JobSecret, SecretSource

KEY = os.urandom(32).hex().encode()
MiB = 2**20
KiB = 1024


@pytest.fixture
def folders() -> Iterator[Callable[[str], Path]]:
    made: list[Path] = []

    def folder(name: str) -> Path:
        made.append(Path("/dev/shm") / f"kelastic-standby-{name}-{uuid.uuid4().hex[:8]}")
        return made[-1]

    yield folder
    for p in made:
        shutil.rmtree(p, ignore_errors=True)


def arrive(k: CheckpointKeeper, cid: int, name: str, size: int = 256 * KiB) -> None:
    part = k.replica_target(cid, name, size)
    part.write_bytes(bytes([cid]) * size)
    k.replica_done(cid, name, part, size)


def held(k: CheckpointKeeper) -> dict[int, set[str]]:
    return {h.id: set(h.files) for h in k.inventory().held}


def test_a_standby_keeps_the_newest_copy_of_each_part(folders: Callable[[str], Path]) -> None:
    k = CheckpointKeeper(CheckpointSettings(root=folders("k"), node="s", limit=MiB), "127.0.0.1:1")
    try:
        arrive(k, 1, "__0.mem")
        arrive(k, 1, "__1.mem")
        arrive(k, 2, "__0.mem")  # checkpoint 1 stays whole until 2 is as whole
        assert held(k) == {1: {"__0.mem", "__1.mem"}, 2: {"__0.mem"}}
        arrive(k, 2, "__1.mem")
        assert held(k) == {2: {"__0.mem", "__1.mem"}}
        # short of memory (1 MiB holds 512 KiB of 2 and 768 KiB only without 2's __0): the
        # older copy of the part goes before the newer one arrives
        arrive(k, 3, "__0.mem", 768 * KiB)
        assert held(k) == {2: {"__1.mem"}, 3: {"__0.mem"}}
        assert k.held_bytes() <= MiB
    finally:
        k.close(remove=True)


def test_a_member_keeps_its_committed_replicas(folders: Callable[[str], Path]) -> None:
    """The rule is a standby's only: a replica of a committed checkpoint stays."""
    k = CheckpointKeeper(CheckpointSettings(root=folders("m"), node="m", limit=MiB), "127.0.0.1:1")
    try:
        arrive(k, 1, "__1.mem")
        k.commit(1, b"m", {"__0.mem": 8, "__1.mem": 256 * KiB}, ["127.0.0.1:1"], 1)
        arrive(k, 2, "__1.mem")
        assert held(k) == {1: {"__1.mem"}, 2: {"__1.mem"}}
    finally:
        k.close(remove=True)


def service(root: Path, **kw: object) -> CheckpointService:
    s = CheckpointService(
        CheckpointSettings(root=root, node=root.name, limit=16 * MiB, replicas=1),
        JobSecret(KEY, SecretSource.FILE),
        host="127.0.0.1",
        **kw,  # type: ignore[arg-type]
    ).start()
    s.keeper.local.set(lambda: [os.getpid()])
    return s


def save(s: CheckpointService, cid: int, size: int = MiB) -> None:
    """One rank's save and its commit, as MemoryWriter makes them (this process is rank 0)."""
    from tests.agent.test_checkpoint_peer_rules import _metadata

    client = ServiceClient(s.endpoint, KEY, timeout=10)
    try:
        reply, _ = client.call({"op": "begin", "rank": 0, "bytes": size, "timeout": 5, "pid": os.getpid()})
        assert "refused" not in reply, reply
        path = client.call({"op": "open", "id": cid, "name": "__0.mem", "size": size, "rank": 0})[0]["path"]
        Path(path).write_bytes(bytes([cid]) * size)
        client.call({"op": "done", "rank": 0})
        client.call({"op": "commit", "id": cid, "required": {"__0.mem": size}, "step": cid}, _metadata(size))
    finally:
        client.close()


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_node_sends_its_newest_part_to_its_standby_after_each_commit(
    folders: Callable[[str], Path],
) -> None:
    spare = service(folders("standby"))
    member = service(folders("member"), standbys=lambda: [StandbyHolder(spare.endpoint, 16 * MiB)])
    try:
        member.set_ring([member.endpoint])  # a ring of one: no peer replica, only the standby's copy
        for cid in (1, 2):
            save(member, cid)
            wait_for(
                f"checkpoint {cid}'s part on the standby",
                lambda cid=cid: held(spare.keeper) == {cid: {"__0.mem"}},
            )
        copy = spare.keeper.path_of(2, "__0.mem").read_bytes()
        assert copy == bytes([2]) * MiB, "the standby's copy is not the part"
    finally:
        member.stop()
        spare.stop()


def test_a_part_dropped_while_it_is_sent_leaves_the_standby_nothing(folders: Callable[[str], Path]) -> None:
    spare = service(folders("standby"))
    source = folders("source")
    source.mkdir(parents=True)
    (source / "part").write_bytes(b"x" * (3 * MiB))
    client = ServiceClient(spare.endpoint, KEY, timeout=10)
    try:
        with pytest.raises(CheckpointError, match="dropped, or no longer wanted, while it was sent"):
            client.put_file(1, "__0.mem", source / "part", 3 * MiB, guard=lambda: False)
        assert held(spare.keeper) == {}

        def whole() -> bool:
            """A whole copy is kept once the service has dropped the broken-off one (until it
            saw that copy's end, the part counts as arriving and a second one is refused)."""
            try:
                client.put_file(1, "__0.mem", source / "part", 3 * MiB, guard=lambda: True)
            except CheckpointError as e:
                if "already" not in str(e):
                    raise
                assert held(spare.keeper) == {}, "a broken-off copy was kept"
                return False
            return True

        wait_for("a whole copy kept after the broken-off one was dropped", whole)
        assert held(spare.keeper) == {1: {"__0.mem"}}
        assert spare.keeper.path_of(1, "__0.mem").read_bytes() == b"x" * (3 * MiB)
    finally:
        client.close()
        spare.stop()


def test_a_copy_no_longer_wanted_stops_between_two_pieces_and_leaves_nothing(
    folders: Callable[[str], Path],
) -> None:
    spare = service(folders("standby"))
    source = folders("source")
    source.mkdir(parents=True)
    (source / "part").write_bytes(b"x" * (8 * MiB))
    asked: list[int] = []

    def stop() -> bool:  # a new round begins once the first piece went
        asked.append(1)
        return len(asked) > 1

    client = ServiceClient(spare.endpoint, KEY, timeout=10)
    try:
        with pytest.raises(CheckpointError, match="no longer wanted"):
            client.put_file(1, "__0.mem", source / "part", 8 * MiB, stop=stop)
        assert len(asked) == 2, "the copy did not stop at the piece after the new round"
        wait_for("the broken-off copy to be dropped", lambda: not spare.keeper._incoming)
        assert held(spare.keeper) == {}
    finally:
        client.close()
        spare.stop()


def test_a_standby_that_failed_is_left_out_for_a_while_within_its_round() -> None:
    assert not _left_out(None, 3, 100.0)
    assert _left_out((3, 110.0), 3, 100.0)
    assert not _left_out((3, 110.0), 3, 110.0)
    assert not _left_out((2, 110.0), 3, 100.0), "a new round tries every standby again"


@pytest.mark.slow  # a store process to start, a connection that times out
def test_standbys_are_announced_signed_and_the_newest_per_node_counts(store: ServerProcess) -> None:
    run = f"run-{uuid.uuid4().hex[:6]}"
    board = StandbyBoard(store.endpoint, run, KEY)
    board.announce("node-s", StandbyHolder("127.0.0.1:1001", MiB))
    board.announce("node-t", StandbyHolder("127.0.0.1:1002", 2 * MiB))
    board.announce("node-s", StandbyHolder("127.0.0.1:1003", MiB))  # node-s restarted
    # a stranger with store access (no secret) writes an announcement of its own
    stranger = StandbyBoard(store.endpoint, run, None)
    stranger.announce("evil", StandbyHolder("127.0.0.2:6666", 10 * MiB))
    reader = StandbyBoard(store.endpoint, run, KEY)
    assert reader.holders() == [
        StandbyHolder("127.0.0.1:1002", 2 * MiB),
        StandbyHolder("127.0.0.1:1003", MiB),
    ]
    assert StandbyBoard(store.endpoint, "another-run", KEY).holders() == []


@pytest.mark.slow  # a store process to start, a connection that times out
def test_a_store_that_cannot_be_reached_reads_as_no_standby() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    assert StandbyBoard(f"127.0.0.1:{port}", "run", KEY).holders() == []
