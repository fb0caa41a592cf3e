"""The rules of the checkpoint service that hold for any peer, one by one: request parsing
(pure), the metadata codec, and the keeper's rules on a real tmpfs folder."""

from __future__ import annotations

import enum
import io
import os
import pickle
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from kelastic.agent.checkpoint import codec
from kelastic.agent.checkpoint import requests as rq
from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.keeper import MAX_ID_JUMP, CheckpointKeeper
from kelastic.agent.checkpoint.plan import Source
from kelastic.agent.checkpoint.settings import CheckpointSettings
from kelastic.agent.checkpoint.storage import MemoryItem

CAPS = {"max_metadata": 1024, "max_part": 4096}


def parse(header: dict[str, Any], length: int = 0, sealed: bool = False) -> rq.Request:
    return rq.parse(header, length, sealed, **CAPS)


def test_well_formed_requests_parse_into_their_types() -> None:
    assert parse({"op": "begin", "rank": 3, "bytes": 10, "timeout": 2.5, "pid": 77}) == rq.Begin(
        3, 10, 2.5, 77
    )
    assert parse({"op": "open", "id": 2, "name": "__0.mem", "size": 64, "rank": 0}) == rq.Open(
        2, "__0.mem", 64, 0
    )
    assert parse({"op": "commit", "id": 2, "required": {"__0.mem": 64}, "step": None}, 10, True) == rq.Commit(
        2, {"__0.mem": 64}, None, 10
    )
    assert parse({"op": "put", "id": 2, "name": "__1.mem"}, 4096) == rq.Put(2, "__1.mem", 4096)
    assert parse({"op": "get", "id": 2, "name": "__1.mem", "offset": 0, "length": 8}) == rq.Get(
        2, "__1.mem", 0, 8
    )
    restored = {"op": "restored", "id": 2, "source": "replica", "seconds": 0.5, "step": 9, "pid": 7}
    assert parse(restored) == rq.Restored(2, Source.REPLICA, 0.5, 9, 7)
    assert parse({"op": "inventory"}) == rq.InventoryRequest()
    assert parse({"op": "inventory", "wait": True, "pull": False}) == rq.InventoryRequest(True, False)


@pytest.mark.parametrize(
    ("header", "length", "sealed", "needle"),
    [
        (
            {"op": "begin", "rank": 0, "bytes": 1, "timeout": 1, "pid": 2**70},
            0,
            False,
            "pid=1180591620717411303424",
        ),
        ({"op": "begin", "rank": 0, "bytes": 1, "timeout": 1, "pid": 0}, 0, False, "out of range 1..4194304"),
        ({"op": "begin", "rank": -1, "bytes": 1, "timeout": 1, "pid": 5}, 0, False, "rank=-1"),
        ({"op": "begin", "rank": 0, "bytes": 1, "timeout": float("nan"), "pid": 5}, 0, False, "timeout=nan"),
        ({"op": "begin", "rank": 0, "bytes": 1, "timeout": 1e9, "pid": 5}, 0, False, "out of range 0..3600"),
        (
            {"op": "begin", "rank": "0", "bytes": 1, "timeout": 1, "pid": 5},
            0,
            False,
            "rank must be an integer",
        ),
        ({"op": "done", "rank": True}, 0, False, "rank must be an integer, got bool"),
        (
            {"op": "open", "id": 1, "name": "../x", "size": 1, "rank": 0},
            0,
            False,
            "not a checkpoint file name",
        ),
        (
            {"op": "open", "id": 1, "name": ".metadata", "size": 1, "rank": 0},
            0,
            False,
            "not a checkpoint file name",
        ),
        (
            {"op": "open", "id": 1, "name": "a" * 200, "size": 1, "rank": 0},
            0,
            False,
            "not a checkpoint file name",
        ),
        ({"op": "open", "id": 1, "name": "a", "size": 2**51, "rank": 0}, 0, False, "size="),
        ({"op": "metadata", "id": 0}, 0, False, "id=0 is out of range"),
        ({"op": "get", "id": 1, "name": "a", "offset": -1, "length": 1}, 0, False, "offset=-1"),
        (
            {"op": "restored", "id": 0, "source": "memory", "seconds": 1, "step": None, "pid": 1},
            0,
            False,
            "id=0",
        ),
        (
            {"op": "restored", "id": 1, "source": "elsewhere", "seconds": 1, "step": None, "pid": 1},
            0,
            False,
            "source",
        ),
        (
            {"op": "restored", "id": 1, "source": ["x"], "seconds": 1, "step": None, "pid": 1},
            0,
            False,
            "source",
        ),
        (
            {"op": "restored", "id": 1, "source": "memory", "seconds": 1, "step": None},
            0,
            False,
            "pid must be",
        ),
        ({"op": "commit", "id": 1, "required": {}, "step": None, "ring": ["x:1"]}, 5, True, "takes no ring"),
        ({"op": "commit", "id": 1, "required": {}, "step": None}, 5, False, "must be sealed"),
        ({"op": "commit", "id": 1, "required": {}, "step": None}, 2048, True, "1..1024 bytes"),
        ({"op": "commit", "id": 1, "required": {}, "step": None}, 0, True, "1..1024 bytes"),
        ({"op": "commit", "id": 1, "required": {"a": -1}, "step": None}, 5, True, "size in bytes"),
        ({"op": "commit", "id": 1, "required": [], "step": None}, 5, True, "map of file name"),
        ({"op": "put", "id": 1, "name": "a"}, 4097, False, "more than this node holds"),
        ({"op": "inventory"}, 64 * 2**20, False, "takes no payload"),
        ({"op": "format-disk"}, 0, False, "unknown operation"),
        ({"op": None}, 0, False, "unknown operation"),
    ],
)
def test_bad_requests_are_refused_with_what_is_wrong(
    header: dict[str, Any], length: int, sealed: bool, needle: str
) -> None:
    with pytest.raises(rq.BadRequest) as info:
        parse(header, length, sealed)
    assert needle in str(info.value), str(info.value)


# --- the metadata codec -------------------------------------------------------------------------
def real_metadata(tmp_path: Path) -> bytes:
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": m.state_dict(), "opt": opt.state_dict(), "step": 5, "h": torch.zeros(3, dtype=torch.bfloat16),
             "cl": torch.zeros(1, 2, 3, 4).to(memory_format=torch.channels_last)}  # fmt: skip
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return (tmp_path / ".metadata").read_bytes()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_reads_and_code_in_it_does_not_run(tmp_path: Path) -> None:
    blob = real_metadata(tmp_path / "ckpt")
    md = codec.loads(blob)
    assert isinstance(md, Metadata) and "model.weight" in md.state_dict_metadata
    assert pickle.loads(blob).state_dict_metadata.keys() == md.state_dict_metadata.keys()
    marker = tmp_path / "ran"

    class Run:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    for evil in (Run(), Metadata(state_dict_metadata={"x": Run()})):  # type: ignore[dict-item]
        with pytest.raises(codec.UnsafeMetadata, match=r"posix\.system"):
            codec.loads(pickle.dumps(evil))
    assert not marker.exists()
    with pytest.raises(codec.UnsafeMetadata, match="not a DCP Metadata"):
        codec.loads(pickle.dumps({"a": 1}))
    with pytest.raises(codec.UnsafeMetadata, match="unreadable"):
        codec.loads(b"\x80\x05garbage")
    with pytest.raises(codec.UnsafeMetadata, match=r"builtins\.eval"):
        codec.loads(b"cbuiltins\neval\n(S'1'\ntR.")


class _Python311Pickler(pickle.Pickler):
    """Pickles an Enum member as Python 3.11.0-3.11.3 do (Debian bookworm's python3):
    ``getattr(EnumClass, "NAME")``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def python311_dumps(value: Any) -> bytes:
    out = io.BytesIO()
    _Python311Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return out.getvalue()


def test_metadata_of_a_python_that_pickles_enums_by_getattr_reads_and_other_getattrs_do_not(
    tmp_path: Path,
) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = pickle.loads(real_metadata(tmp_path / "ckpt"))
    md.storage_data = {MetadataIndex("model.weight"): MemoryItem("__0.mem", 0, 64)}
    blob = python311_dumps(md)
    assert b"getattr" in blob
    assert codec.loads(blob).state_dict_metadata.keys() == md.state_dict_metadata.keys()
    codec.check_commit(blob, {"__0.mem": 128})
    for evil in (
        b"\x80\x02cbuiltins\ngetattr\ncpathlib\nPosixPath\nX\x04\x00\x00\x00home\x86R.",
        b"\x80\x02cbuiltins\ngetattr\nctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
        b"X\x09\x00\x00\x00__class__\x86R.",
    ):
        with pytest.raises(codec.UnsafeMetadata, match="getattr"):
            codec.loads(evil)


def test_a_commit_s_items_must_lie_in_its_files() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): MemoryItem("__0.mem", 64, 64)})
    codec.check_commit(codec.dumps(md), {"__0.mem": 128})
    with pytest.raises(codec.UnsafeMetadata, match="outside the files"):
        codec.check_commit(codec.dumps(md), {"__0.mem": 100})
    with pytest.raises(codec.UnsafeMetadata, match="outside the files"):
        codec.check_commit(codec.dumps(md), {"__1.mem": 128})
    bad = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): MemoryItem("__0.mem", "0", 1)})  # type: ignore[arg-type]
    with pytest.raises(codec.UnsafeMetadata, match="malformed"):
        codec.check_commit(codec.dumps(bad), {"__0.mem": 128})


# --- the keeper's rules ---------------------------------------------------------------------------
@pytest.fixture
def keeper() -> Iterator[CheckpointKeeper]:
    root = Path("/dev/shm") / f"kelastic-rules-{uuid.uuid4().hex[:8]}"
    k = CheckpointKeeper(
        CheckpointSettings(root=root, node="n", limit=1024 * 1024, replicas=1), "127.0.0.1:1"
    )
    yield k
    k.close(remove=True)
    shutil.rmtree(root, ignore_errors=True)


def save(k: CheckpointKeeper, cid: int, size: int = 1024, meta: bytes = b"m") -> None:
    _, refusal = k.begin(0, size, 5, os.getpid())
    assert refusal is None
    k.open(cid, "__0.mem", size, 0)
    k.done(0)
    assert k.commit(cid, meta, {"__0.mem": size}, ["127.0.0.1:1"], cid)


def test_a_committed_checkpoint_is_final(keeper: CheckpointKeeper) -> None:
    save(keeper, 1)
    assert keeper.commit(1, b"m", {"__0.mem": 1024}, ["x:1"], 1) is False  # the same again: a retry
    with pytest.raises(CheckpointError, match="committed already"):
        keeper.commit(1, b"other", {"__0.mem": 1024}, ["x:1"], 1)
    with pytest.raises(CheckpointError, match="not newer than the committed"):
        keeper.open(1, "__0.mem", 1024, 0)
    with pytest.raises(CheckpointError, match="never replaced"):
        keeper.replica_target(1, "__0.mem", 1024)
    part = keeper.replica_target(1, "__1.mem", 512)  # a part it does not hold yet: taken
    part.write_bytes(b"\0" * 512)
    keeper.replica_done(1, "__1.mem", part, 512)
    with pytest.raises(CheckpointError, match="never replaced"):
        keeper.replica_target(1, "__1.mem", 512)
    assert keeper.metadata(1) == b"m"


def test_a_restore_report_drops_nothing(keeper: CheckpointKeeper) -> None:
    save(keeper, 1)
    save(keeper, 2)
    keeper.restored(1, "memory", 0.1, None, os.getpid())
    assert [h.id for h in keeper.inventory().held] == [1, 2]
    # the restored older one is kept beside the newest through the next save
    save(keeper, 3)
    assert [h.id for h in keeper.inventory().held] == [1, 2, 3]
    _, refusal = keeper.begin(0, 1024, 5, os.getpid())
    assert refusal is None
    keeper.open(4, "__0.mem", 1024, 0)
    assert [h.id for h in keeper.inventory().held] == [3, 4]


def test_reservations_name_a_live_process_of_the_node(keeper: CheckpointKeeper) -> None:
    with pytest.raises(CheckpointError, match="not pid 0"):
        keeper.begin(0, 10, 1, 0)
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    with pytest.raises(CheckpointError, match="no process its agent started"):
        keeper.begin(0, 10, 1, gone)  # a process that is gone reserves nothing
    _, refusal = keeper.begin(0, 10, 0.1, os.getpid())
    assert refusal is None


def test_a_new_group_voids_the_saves_the_previous_group_began(keeper: CheckpointKeeper) -> None:
    """A worker kept across a re-form (the same live pid) whose old save stays blocked on the
    broken group: its new group's save does not wait for the old one."""
    _, refusal = keeper.begin(0, 1024, 5, os.getpid())
    assert refusal is None
    _, refusal = keeper.begin(0, 1024, 0.1, os.getpid())  # the same rank and process, in the same group
    assert refusal is not None and "previous save is still being written" in refusal.reason
    keeper.new_group()
    _, refusal = keeper.begin(0, 1024, 0.1, os.getpid())  # the new group's first save
    assert refusal is None


def test_memory_is_counted_for_opens_incoming_replicas_and_metadata(keeper: CheckpointKeeper) -> None:
    save(keeper, 1, size=300 * 1024)
    incoming = keeper.replica_target(2, "__1.mem", 500 * 1024)  # announced, nothing sent yet
    assert incoming.stat().st_size == 0, "nothing is allocated for bytes that did not arrive"
    with pytest.raises(CheckpointError, match="limit"):
        keeper.open(2, "__0.mem", 300 * 1024, 0)
    assert [h.id for h in keeper.inventory().held] == [1], "a refused open dropped nothing"
    keeper.replica_failed(2, "__1.mem", incoming)
    assert not incoming.exists()
    keeper.open(2, "__0.mem", 300 * 1024, 0)
    with pytest.raises(CheckpointError, match="metadata"):
        keeper.commit(2, b"m" * 600 * 1024, {"__0.mem": 300 * 1024}, ["x:1"], 2)


def test_numbers_may_not_run_away(keeper: CheckpointKeeper) -> None:
    save(keeper, 1)
    with pytest.raises(CheckpointError, match="past the newest"):
        keeper.open(2 + MAX_ID_JUMP, "__0.mem", 10, 0)
    with pytest.raises(CheckpointError, match="past the newest"):
        keeper.replica_target(2 + MAX_ID_JUMP, "__0.mem", 10)
    with pytest.raises(CheckpointError, match="past its end"):
        keeper.readable(1, "__0.mem", 1000, 100)


# --- a peer that holds the secret: only the node's own ranks save and restore here ---------------
def test_only_the_node_s_own_ranks_begin_open_and_report_restores(keeper: CheckpointKeeper) -> None:
    """With the agent's workers named (here: this process), a begin or a restore report of any
    other process is refused, an open needs its rank's begin, and a reservation goes with
    its process."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        keeper.local.set(lambda: [os.getpid()])
        save(keeper, 1)
        save(keeper, 2)
        with pytest.raises(CheckpointError, match="no process its agent started"):
            keeper.begin(5, 10, 1, 1)  # pid 1: alive, not ours
        with pytest.raises(CheckpointError, match="no process its agent started"):
            keeper.restored(1, "memory", 0.1, None, 1)
        with pytest.raises(CheckpointError, match="no save begun"):
            keeper.open(3, "__9.mem", 10, 9)
        # a rank's helper process (a child of a worker) is one of the node's own
        keeper.restored(1, "memory", 0.1, None, child.pid)
        # a reservation goes when its process goes: every later save fits again
        keeper.local.set(lambda: [os.getpid(), child.pid])
        _, refusal = keeper.begin(7, keeper.settings.limit // 3, 1, child.pid)
        assert refusal is None
        child.kill()
        child.wait()
        _, refusal = keeper.begin(0, keeper.settings.limit // 3, 1, os.getpid())
        assert refusal is None, refusal
    finally:
        child.kill()
        keeper.local.set(None)


def test_a_restore_report_of_an_older_checkpoint_then_a_begin_for_the_limit_drops_no_commit(
    keeper: CheckpointKeeper,
) -> None:
    keeper.local.set(lambda: [os.getpid()])
    save(keeper, 1)
    save(keeper, 2)
    with pytest.raises(CheckpointError):
        keeper.restored(1, "memory", 0.1, None, 1)  # from a peer's process: refused
    _, refusal = keeper.begin(0, keeper.settings.limit, 1, os.getpid())
    assert refusal is not None
    assert keeper.status()["latest"] == 2
    keeper.local.set(None)


def test_a_peer_s_replica_of_a_newer_checkpoint_does_not_supersede_a_save(keeper: CheckpointKeeper) -> None:
    save(keeper, 1)
    _, refusal = keeper.begin(0, 1024, 5, os.getpid())
    assert refusal is None
    keeper.open(2, "__0.mem", 1024, 0)
    far = keeper.replica_target(2 + MAX_ID_JUMP - 10, "__1.mem", 8)  # within the bound, far ahead
    far.write_bytes(b"\0" * 8)
    keeper.replica_done(2 + MAX_ID_JUMP - 10, "__1.mem", far, 8)
    keeper.done(0)
    assert keeper.commit(2, b"m", {"__0.mem": 1024}, ["x:1"], 2)


def test_headers_and_metadata_being_read_count_against_the_limit(keeper: CheckpointKeeper) -> None:
    keeper.reserve(keeper.settings.limit - 100, "a header")
    with pytest.raises(CheckpointError, match="cannot read"):
        keeper.reserve(200, "a commit's metadata")
    keeper.begin(0, 1024, 0.1, os.getpid())
    with pytest.raises(CheckpointError, match="limit"):
        keeper.open(1, "__0.mem", 1024, 0)
    keeper.release(keeper.settings.limit - 100)
    keeper.done(0)
    save(keeper, 1)
