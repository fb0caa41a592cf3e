"""MemoryWriter/MemoryReader against real checkpoint services (real sockets, real tmpfs files,
real torch.distributed.checkpoint), in one process: ``no_dist`` saves and loads, services
that play the other nodes of a group.
"""

from __future__ import annotations

import dataclasses
import io
import os
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

from kelastic.agent.checkpoint.errors import CheckpointTooLarge, NotInKelasticWorker
from kelastic.agent.checkpoint.plan import Source
from kelastic.agent.checkpoint.service import CheckpointService
from kelastic.agent.checkpoint.settings import CheckpointSettings
from kelastic.agent.contract import ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_ENDPOINT
from kelastic.agent.secret import JobSecret, secret_from_file
from kelastic.checkpoint import MemoryReader, MemoryWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Started(list[CheckpointService]):
    """The services a test started, and the job's secret they share."""

    def __init__(self, secret: JobSecret) -> None:
        super().__init__()
        self.secret = secret


@pytest.fixture(scope="module")
def job_secret(tmp_path_factory: pytest.TempPathFactory) -> JobSecret:
    path = tmp_path_factory.mktemp("secret") / "job-secret"
    path.write_text(uuid.uuid4().hex * 2)
    return secret_from_file(str(path))


@pytest.fixture
def services(shm: Path, job_secret: JobSecret) -> Iterator[Started]:
    started = Started(job_secret)
    yield started
    for s in started:
        s.stop(remove=True)


def service(started: list[CheckpointService], shm: Path, name: str, **kw: Any) -> CheckpointService:
    assert isinstance(started, Started)
    opts: dict[str, Any] = {"limit": 256 * 2**20, **kw}
    s = CheckpointService(
        CheckpointSettings(root=shm / name, node=name, **opts),
        started.secret,
        host="127.0.0.1",
        advertise="127.0.0.1",
    ).start()
    started.append(s)
    return s


def worker_of(s: CheckpointService, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s.worker_env().items():
        monkeypatch.setenv(k, v)


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 32, generator=g)
    return {
        "w": torch.randn(256, 128, generator=g),
        "half": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "strided": base.t(),  # not contiguous
        "scalar": torch.tensor(seed, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "flags": torch.rand(17, generator=g) > 0.5,
        "meta": {"seed": seed, "name": "kelastic"},
    }


def blank() -> dict[str, Any]:
    s = state(0)
    return {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": -1, "name": ""})
        for k, v in s.items()
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            if not (v.dtype == b[k].dtype and v.shape == b[k].shape and torch.equal(v, b[k])):
                return False
        elif v != b[k]:
            return False
    return True


def original(e: CheckpointException) -> BaseException:
    """The exception a rank raised inside DCP (DCP wraps it with its traceback)."""
    wrapped = next(iter(e.failures.values()))
    return wrapped[0] if isinstance(wrapped, tuple) else wrapped


def save(s: dict[str, Any], **kw: Any) -> None:
    dcp.save(s, storage_writer=MemoryWriter(**kw), no_dist=True)


def load() -> tuple[dict[str, Any], MemoryReader]:
    target, reader = blank(), MemoryReader()
    dcp.load(target, storage_reader=reader, no_dist=True)
    return target, reader


def test_outside_a_kelastic_worker_both_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CHECKPOINT_ENDPOINT, raising=False)
    monkeypatch.delenv(ENV_CHECKPOINT_DIR, raising=False)
    for cls in (MemoryWriter, MemoryReader):
        with pytest.raises(NotInKelasticWorker, match="kelastic-agent"):
            cls()


def test_a_save_and_a_load_are_bit_identical_and_the_newest_wins(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    assert not MemoryReader().exists()
    save(state(1), step=10)
    save(state(2), step=20)
    got, reader = load()
    assert same(got, state(2))
    assert reader.choice is not None and (reader.choice.id, reader.choice.step, reader.choice.source) == (
        2,
        20,
        Source.MEMORY,
    )
    status = a.keeper.status()
    assert (
        status["latest"] == 2 and status["restored"]["id"] == 2 and status["restored"]["source"] == "memory"
    )


def test_only_the_last_complete_checkpoint_is_kept_and_files_are_reused(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    for seed in range(1, 5):
        save(state(seed))
        if seed == 1:
            first = next((shm / "a" / "ckpt-0000000001").glob("__*")).stat().st_ino
    # the one before the newest stays until the next save writes (peers' replicas of the
    # newest may still be on their way); everything older is gone
    held = [h.id for h in a.keeper.inventory().held]
    assert held == [3, 4], held
    # checkpoint 1's file went to the reuse pool when 3 was written, and 3 took it: its pages
    # were already allocated
    assert next((shm / "a" / "ckpt-0000000003").glob("__*")).stat().st_ino == first


def test_the_pace_of_saves_is_what_the_restart_loop_waits_on(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cadence`` and ``wait_committed``: how a restart for joining nodes lands right after
    a checkpoint (see restart_policy.defer_join)."""
    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    assert a.keeper.cadence() == (None, None, None)
    assert a.keeper.wait_committed(0, 0.05) is False
    save(state(1))
    latest, age, interval = a.keeper.cadence()
    assert latest == 1 and age is not None and age >= 0 and interval is None
    time.sleep(0.2)
    save(state(2))
    latest, age, interval = a.keeper.cadence()
    assert latest == 2 and age is not None and interval is not None and interval >= 0.2
    assert a.keeper.wait_committed(1, 0.0) is True
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(a.keeper.wait_committed(2, 30)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive(), "no checkpoint after 2 yet"
    save(state(3))
    waiter.join(10)
    assert waited == [True]


def test_a_rank_keeps_its_mappings_between_saves_and_drops_those_of_deleted_files(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the third save on a rank writes into a file it mapped before (no page faults, no
    unmapping); a file the agent deleted is never kept mapped past the next save's start."""
    from kelastic.agent.checkpoint import storage

    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    monkeypatch.setattr(storage, "_mappings", storage._Mappings())
    for seed in range(1, 6):
        save(state(seed))
    kept = dict(storage._mappings._maps)
    assert 1 <= len(kept) <= storage._Mappings.KEEP
    inode = next((shm / "a" / "ckpt-0000000005").glob("__*")).stat().st_ino
    assert inode in {ino for _dev, ino in kept}, "the newest file is one the rank had mapped"
    save(state(6))
    got, _ = load()
    assert same(got, state(6))
    # the agent frees memory: the mappings of deleted files go before the next file is asked for
    for f in (shm / "a").rglob("__*"):
        f.unlink()
    fds = [fd for fd, _mm, _size in storage._mappings._maps.values()]
    storage._mappings.prune()
    assert storage._mappings._maps == {}
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed: the deleted file's memory is released


def test_async_save_works(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    fut = dcp.async_save(state(3), storage_writer=MemoryWriter(), no_dist=True)
    result = fut.result() if hasattr(fut, "result") else fut.upload_completion.result()  # type: ignore[union-attr]
    assert result is not None
    got, _ = load()
    assert same(got, state(3))


def test_a_save_that_does_not_fit_writes_nothing_and_the_previous_stands(
    services: list[CheckpointService],
    shm: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = service(services, shm, "a", limit=600 * 2**10)  # room for one small state with its copy
    worker_of(a, monkeypatch)
    save(state(1))
    big = {**state(2), "huge": torch.zeros(1024, 1024)}  # 4 MiB
    save(big)  # skipped, training goes on
    err = capsys.readouterr().err
    assert "not saved" in err and "needs" in err and "limit is 600 KiB" in err, err
    got, reader = load()
    assert same(got, state(1)) and reader.choice is not None and reader.choice.id == 1
    with pytest.raises(CheckpointException) as info:
        save(big, strict=True)
    cause = original(info.value)
    assert isinstance(cause, CheckpointTooLarge) and "limit is 600 KiB" in str(cause)
    assert a.keeper.status()["refused"] == 2


def test_a_torn_save_is_never_loaded(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that wrote its part but never committed (its node died before the coordinator's
    commit) leaves the previous checkpoint standing; the next save drops the torn one."""
    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    save(state(1))

    class Torn(MemoryWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            raise RuntimeError("the coordinator died before committing")

    with pytest.raises(CheckpointException) as info:
        dcp.save(state(2), storage_writer=Torn(), no_dist=True)
    assert "coordinator died" in str(original(info.value))
    assert [(h.id, h.required is not None) for h in a.keeper.inventory().held] == [(1, True), (2, False)]
    got, reader = load()
    assert same(got, state(1)) and reader.choice is not None and reader.choice.id == 1
    save(state(3))
    assert [h.id for h in a.keeper.inventory().held] == [1, 3]


def test_a_commit_of_a_superseded_save_is_refused(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two saves that overlap: the older one cannot commit after the newer one began."""
    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    save(state(1))
    client = a.client(a.endpoint)
    try:
        client.call({"op": "open", "id": 5, "name": "__0.mem", "size": 64, "rank": 0})
        with pytest.raises(Exception, match="superseded"):
            client.call({"op": "commit", "id": 4, "required": {}, "step": None}, empty_metadata())
    finally:
        client.close()


def empty_metadata() -> bytes:
    from torch.distributed.checkpoint.metadata import Metadata

    from kelastic.agent.checkpoint import codec

    return codec.dumps(Metadata(state_dict_metadata={}, storage_data={}))


def wait_background(s: CheckpointService, timeout: float = 30) -> None:
    """Until the service's replication and durable copies are done (it works off the save path)."""
    deadline = time.monotonic() + timeout
    while (s.keeper._outgoing or s.keeper._pinned) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not s.keeper._outgoing and not s.keeper._pinned


class OnRing(MemoryWriter):
    """A writer whose plan names ``ring`` as the ring its commit replicates on (the ring of
    the rendezvous round, which each agent tells its service), as a worker's would."""

    def __init__(self, ring: list[str], **kw: Any) -> None:
        super().__init__(**kw)
        self._ring = tuple(ring)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        out = super().prepare_global_plan(plans)
        return [
            dataclasses.replace(p, storage_data=dataclasses.replace(p.storage_data, ring=self._ring))
            for p in out
        ]


def test_a_lost_node_s_part_is_restored_from_its_successor_s_replica(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = service(services, shm, "a")
    b = service(services, shm, "b")
    worker_of(a, monkeypatch)
    # a group of two nodes in which node a wrote everything: b sits on the ring after a (the
    # ring of the rendezvous round, which each agent tells its service) and gets the commit
    ring = [a.endpoint, b.endpoint]
    for s in (a, b):
        s.set_ring(ring)

    dcp.save(state(7), storage_writer=OnRing(ring, step=70), no_dist=True)
    wait_background(a)
    held_b = b.keeper.inventory().held
    assert (
        len(held_b) == 1 and held_b[0].replicas == frozenset({"__0.mem"}) and held_b[0].required is not None
    )
    a.stop(remove=True)  # node a is gone, its memory with it
    services.remove(a)
    worker_of(b, monkeypatch)  # a worker of the re-formed group, on node b
    got, reader = load()
    assert same(got, state(7))
    assert reader.choice is not None and (reader.choice.source, reader.choice.step) == (Source.REPLICA, 70)


def test_the_durable_copy_is_read_by_plain_dcp_and_restored_when_memory_is_empty(
    services: list[CheckpointService], shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable = tmp_path / "durable"
    a = service(services, shm, "a", persist_dir=durable, persist_every=2)
    worker_of(a, monkeypatch)
    for seed in range(1, 6):
        save(state(seed))
    wait_background(a)
    assert sorted(p.name for p in durable.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    plain = blank()
    dcp.load(plain, storage_reader=dcp.FileSystemReader(durable / "checkpoint-4"), no_dist=True)
    assert same(plain, state(4))
    a.stop(remove=True)
    services.remove(a)
    fresh = service(services, shm, "a2", persist_dir=durable)
    worker_of(fresh, monkeypatch)
    got, reader = load()
    assert same(got, state(4)) and reader.choice is not None and reader.choice.source is Source.DURABLE


def test_a_restarted_agent_takes_over_the_committed_checkpoints_of_its_node(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    save(state(5))
    a._listener.close()  # the agent died; its tmpfs folder stays (a container restart)
    services.remove(a)
    again = service(services, shm, "a")
    worker_of(again, monkeypatch)
    got, _ = load()
    assert same(got, state(5))


def test_bytes_items_round_trip(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    save({"blob": io.BytesIO(b"kelastic" * 100), "t": torch.arange(5)})
    target = {"blob": io.BytesIO(), "t": torch.zeros(5, dtype=torch.int64)}
    dcp.load(target, storage_reader=MemoryReader(), no_dist=True)
    assert target["blob"].getvalue() == b"kelastic" * 100 and torch.equal(target["t"], torch.arange(5))


def test_the_agents_metrics_show_saves_restores_and_memory(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kelastic.agent.telemetry import AgentTelemetry

    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    telemetry = AgentTelemetry()
    telemetry.watch_checkpoint(a.keeper.status)
    save(state(1))
    save(state(2))
    load()
    text = telemetry.render()
    assert "kelastic_agent_checkpoint_latest 2" in text
    assert "kelastic_agent_checkpoint_saves_total 2" in text
    assert 'kelastic_agent_checkpoint_restores_total{source="memory"} 1' in text
    assert "kelastic_agent_checkpoint_limit_bytes 268435456" in text
    held = next(line for line in text.splitlines() if line.startswith("kelastic_agent_checkpoint_bytes "))
    assert float(held.split()[1]) > 0


@pytest.mark.slow
def test_the_injected_agent_brings_kelastic_checkpoint_to_a_torch_only_python(
    services: list[CheckpointService], shm: Path, tmp_path: Path
) -> None:
    """A worker image with torch and nothing of kelastic saves and restores through the copy
    of the agent that the operator injects."""
    import json
    import os
    import subprocess

    from kelastic.agent import contract
    from kelastic.agent.inject import install
    from kelastic.localcluster.kubelet.images import torch_environment

    a = service(services, shm, "a")
    python = torch_environment(tmp_path / "venv")
    install(tmp_path / "agent")
    program = (
        "import json, sys, torch\n"
        f"sys.path.insert(0, {str(tmp_path / 'agent' / contract.INJECT_LIB)!r})\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from kelastic.checkpoint import MemoryReader, MemoryWriter\n"
        "dcp.save({'w': torch.arange(6.0)}, storage_writer=MemoryWriter(step=3), no_dist=True)\n"
        "got = {'w': torch.zeros(6)}\n"
        "r = MemoryReader()\n"
        "dcp.load(got, storage_reader=r, no_dist=True)\n"
        "print(json.dumps([got['w'].tolist(), r.choice.step, MemoryWriter.__module__]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | a.worker_env()
    proc = subprocess.run([str(python), "-c", program], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        3,
        "kelastic.agent.checkpoint.storage",
    ]


def test_a_durable_copy_at_an_fsspec_url_is_written_metadata_last_and_restored(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fsspec URL (here fsspec's in-process memory filesystem, standing in for s3:// and
    the like) as the durable directory: DCP's own FsspecReader reads the copy."""
    import fsspec
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url = f"memory://kelastic-{uuid.uuid4().hex[:6]}/durable"
    a = service(services, shm, "a", persist_dir=url)
    worker_of(a, monkeypatch)
    save(state(6))
    wait_background(a)
    fs, root = fsspec.core.url_to_fs(url)
    assert fs.exists(f"{root}/checkpoint-1/.metadata")
    plain = blank()
    dcp.load(plain, storage_reader=FsspecReader(f"{url}/checkpoint-1"), no_dist=True)
    assert same(plain, state(6))
    a.stop(remove=True)
    services.remove(a)
    fresh = service(services, shm, "a2", persist_dir=url)
    worker_of(fresh, monkeypatch)
    got, reader = load()
    assert same(got, state(6)) and reader.choice is not None and reader.choice.source is Source.DURABLE


def test_a_node_that_holds_nothing_reads_every_part_from_its_peers(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that joined after the save (a scale-up, a replacement) restores over the network:
    whole tensors straight into their targets, the others (a strided target, bytes) through a
    buffer; bit-identical either way."""
    a = service(services, shm, "a", replicas=0)
    b = service(services, shm, "b", replicas=0)
    worker_of(a, monkeypatch)
    save(state(8), step=80)

    class Both(MemoryReader):
        """The inventories of a group of two (gathered by all_gather_object in a real one)."""

        @property
        def choice(self) -> Any:
            if not self._chosen:
                self._began = time.monotonic()
                from kelastic.agent.checkpoint.plan import choose_restore

                self._choice = choose_restore([s.keeper.inventory() for s in (a, b)])
                self._chosen = True
            return self._choice

    worker_of(b, monkeypatch)
    target, reader = blank(), Both()
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert same(target, state(8))
    assert reader.choice.holders and all(h == (a.endpoint,) for h in reader.choice.holders.values())
    assert not any((shm / "b").glob("ckpt-*/__*")), "b held no part: everything came over the network"


def test_a_local_part_is_read_in_place_bit_identical_and_a_short_one_is_refused(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole tensors are read from the node's file straight into their targets (the targets
    keep their storage), the rest through a mapping; a file cut short is refused by name."""
    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    save(state(10), step=100)
    target = blank()
    storage = target["w"].untyped_storage().data_ptr()
    reader = MemoryReader()
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert same(target, state(10))
    assert target["w"].untyped_storage().data_ptr() == storage, "read into the target itself"
    assert reader.local_bytes > 0 and reader.fetched_bytes == 0

    (part,) = (shm / "a").glob("ckpt-*/__0.mem")
    with open(part, "r+b") as f:
        f.truncate(os.fstat(f.fileno()).st_size // 2)
    with pytest.raises(CheckpointException) as e:
        dcp.load(blank(), storage_reader=MemoryReader(), no_dist=True)
    assert "__0.mem" in str(original(e.value)) and "damaged" in str(original(e.value))


class _AllOf(MemoryReader):
    """A reader that chooses from the inventories of ``nodes`` (gathered by
    all_gather_object in a real group)."""

    nodes: tuple[CheckpointService, ...] = ()

    @property
    def choice(self) -> Any:
        if not self._chosen:
            self._began = time.monotonic()
            from kelastic.agent.checkpoint.plan import choose_restore

            self._choice = choose_restore([s.keeper.inventory() for s in self.nodes])
            self._chosen = True
        return self._choice


def test_a_part_two_nodes_hold_is_fetched_from_both_and_a_failing_holder_hands_over(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node c lacks node a's part, which a holds and b holds as a replica: the items come from
    a and b at once; when b fails after the choice they all come from a, bit-identical
    either way."""
    a, b, c = (service(services, shm, n) for n in "abc")
    ring = [a.endpoint, b.endpoint, c.endpoint]
    for s in (a, b, c):
        s.set_ring(ring)

    worker_of(a, monkeypatch)
    dcp.save(state(9), storage_writer=OnRing(ring, step=90), no_dist=True)
    wait_background(a)
    assert b.keeper.inventory().held[0].replicas == frozenset({"__0.mem"})

    served: list[str] = []
    send_range = CheckpointService._send_range

    def counted(self: CheckpointService, channel: Any, req: Any) -> None:
        served.append(self.endpoint)
        send_range(self, channel, req)

    monkeypatch.setattr(CheckpointService, "_send_range", counted)

    class Group(_AllOf):
        nodes = (a, b, c)

    worker_of(c, monkeypatch)
    target, reader = blank(), Group()
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert same(target, state(9))
    assert reader.local_bytes == 0 and reader.fetched_bytes > 0
    assert set(served) == {a.endpoint, b.endpoint}, f"items served by {served}: expected both holders"

    target, reader = blank(), Group()
    assert reader.exists()  # chosen while b holds the replica ...
    b.stop(remove=True)  # ... which fails then: what b would have served comes from a
    services.remove(b)
    served.clear()
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert same(target, state(9))
    assert set(served) == {a.endpoint}


class _Pwn:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_part_whose_object_item_would_run_code_is_refused_naming_it(
    services: list[CheckpointService], shm: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A non-tensor item changed into a pickle that runs code (as whoever could write the
    part's bytes would): the restore refuses it, naming the item and what it needs, and
    the code never runs; plain values and BytesIO items still restore."""
    import pickle

    from kelastic.agent.checkpoint import codec

    a = service(services, shm, "a")
    worker_of(a, monkeypatch)
    save({"w": torch.arange(4.0), "name": "kelastic" * 500})
    cid = a.keeper.inventory().held[-1].id
    fqn, where = next(
        (i.fqn, w) for i, w in codec.loads(a.keeper.metadata(cid)).storage_data.items() if i.fqn == "name"
    )
    marker = tmp_path / "pwned"
    for evil, names in ((pickle.dumps(_Pwn(marker)), ""), (_torch_saved(_Pwn(marker)), "system")):
        assert len(evil) <= where.length
        with open(a.keeper.path_of(cid, where.relative_path), "r+b") as f:
            f.seek(where.offset)
            f.write(evil.ljust(where.length, b"\0"))
        with pytest.raises(CheckpointException) as e:
            dcp.load({"w": torch.zeros(4), "name": ""}, storage_reader=MemoryReader(), no_dist=True)
        message = str(original(e.value))
        assert repr(fqn) in message and "weights_only" in message and names in message, message
        assert not marker.exists(), "a checkpoint item ran code"


def _torch_saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
