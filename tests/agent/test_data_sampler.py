"""``kelastic.data.ElasticSampler``: a data position that survives any resize of the group.

Table tests pin the stream, the tail and the epochs; a hypothesis property test drives
random runs (steps consumed, batches in flight lost, resizes, epoch ends) and checks that
each epoch yields every index exactly once; a real prefetching DataLoader with worker
processes and a real ``dcp.save``/``dcp.load`` over gloo at two world sizes check the
two ways the position is driven and stored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from kelastic.data import ElasticSampler

SCRIPTS = Path(__file__).parent / "scripts"


def group(n: int, batch: int, world: int, **kw: Any) -> list[ElasticSampler]:
    """One sampler per rank of a group of ``world``."""
    return [ElasticSampler(n, batch, r, world, **kw) for r in range(world)]


def steps(samplers: list[ElasticSampler]) -> list[list[list[int]]]:
    """The rest of the epoch, step by step: each step is every rank's batch, by rank."""
    return [list(step) for step in zip(*(list(s) for s in samplers), strict=True)]


def flat(batches: list[list[list[int]]]) -> list[int]:
    return [i for step in batches for batch in step for i in batch]


# -- the stream, the tail, the epochs ---------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "batch", "world", "drop_last", "expected"),
    [
        # world size 1: plain batches, a short last one
        (5, 2, 1, False, [[[0, 1]], [[2, 3]], [[4]]]),
        (5, 2, 1, True, [[[0, 1]], [[2, 3]]]),
        # batch size 1: one index per rank per step; the tail of 1 leaves rank 1 an empty batch
        (5, 1, 2, False, [[[0], [1]], [[2], [3]], [[4], []]]),
        # contiguous slices per rank; the short tail is split evenly (sizes differ by at most 1)
        (10, 2, 3, False, [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8], [9]]]),
        (11, 2, 2, False, [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10]]]),
        # a full step would leave 1 sample for 3 ranks: the step before the last takes 3 fewer,
        # and the last gives each rank one (no empty batch, none larger than batch_size)
        (7, 2, 3, False, [[[0, 1], [2], [3]], [[4], [5], [6]]]),
        (13, 2, 3, False, [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8], [9]], [[10], [11], [12]]]),
        (13, 2, 3, True, [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10, 11]]]),
        # a dataset smaller than one global step: one short step, ranks beyond it get []
        (3, 2, 4, False, [[[0], [1], [2], []]]),
        (3, 2, 4, True, []),
        (8, 2, 4, False, [[[0, 1], [2, 3], [4, 5], [6, 7]]]),
        (0, 2, 2, False, []),
    ],
)
def test_unshuffled_stream_is_cut_into_global_steps(
    n: int, batch: int, world: int, drop_last: bool, expected: list[list[list[int]]]
) -> None:
    samplers = group(n, batch, world, shuffle=False, drop_last=drop_last)
    assert steps(samplers) == expected
    assert {len(s) for s in samplers} == {len(expected)}


def test_shuffled_stream_is_the_seeded_permutation_of_the_epoch() -> None:
    # The same permutation DistributedSampler draws for (seed, epoch), cut into global steps.
    samplers = group(23, 2, 3, seed=5)
    g = torch.Generator()
    g.manual_seed(5 + 0)
    assert flat(steps(samplers)) == torch.randperm(23, generator=g).tolist()
    for s in samplers:
        s.set_epoch(1)
    g.manual_seed(5 + 1)
    assert flat(steps(samplers)) == torch.randperm(23, generator=g).tolist()
    assert sorted(flat(steps(group(23, 2, 3, seed=6)))) == list(range(23))
    assert flat(steps(group(23, 2, 3, seed=6))) != flat(steps(group(23, 2, 3, seed=5)))


@pytest.mark.slow  # a fresh interpreter importing torch: seconds, more on a loaded machine
def test_the_stream_is_the_same_in_another_process() -> None:
    program = (
        "import json; from kelastic.data import ElasticSampler\n"
        "s = ElasticSampler(1000, 7, 2, 5, seed=1234)\n"
        "s.set_epoch(3)\n"
        "print(json.dumps(list(s)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    here = ElasticSampler(1000, 7, 2, 5, seed=1234)
    here.set_epoch(3)
    assert json.loads(proc.stdout) == list(here)


def test_state_is_the_same_on_every_rank_and_counts_consumed_steps_only() -> None:
    samplers = group(20, 3, 2, seed=1)
    its = [iter(s) for s in samplers]
    for it in its:  # three batches drawn ahead (a prefetching loader), one consumed
        next(it), next(it), next(it)
    for s in samplers:
        s.advance()
    states = [s.state_dict() for s in samplers]
    assert states == [{"epoch": 0, "consumed": 6, "dataset_len": 20, "seed": 1, "shuffle": True}] * 2
    # the two batches in flight are redone at the new world size, not skipped
    resumed = group(20, 3, 3, seed=1)
    for s in resumed:
        s.load_state_dict(states[0])
    full = flat(steps(group(20, 3, 1, seed=1)))
    assert flat(steps(resumed)) == full[6:]


def test_epoch_advances_when_its_last_step_is_consumed() -> None:
    s = ElasticSampler(10, 4, 0, 1, shuffle=False)
    assert len(s) == 3
    s.advance(2)
    assert (s.epoch, s.consumed, len(s)) == (0, 8, 1)
    s.advance()
    assert (s.epoch, s.consumed, len(s)) == (1, 0, 3)
    s.advance(4)  # steps count on into the next epochs
    assert (s.epoch, s.consumed) == (2, 4)
    # drop_last: the epoch ends when less than a full step is left
    d = ElasticSampler(10, 4, 0, 1, shuffle=False, drop_last=True)
    d.advance(2)
    assert (d.epoch, d.consumed, len(d)) == (1, 0, 2)


def test_set_epoch_keeps_a_resumed_position_in_the_same_epoch() -> None:
    s = ElasticSampler(30, 2, 0, 2, seed=3)
    s.load_state_dict({"epoch": 4, "consumed": 12, "dataset_len": 30, "seed": 3, "shuffle": True})
    s.set_epoch(4)
    assert (s.epoch, s.consumed) == (4, 12)
    s.set_epoch(5)
    assert (s.epoch, s.consumed) == (5, 0)
    # a position at an epoch's very end (saved that way by hand): nothing left, the next step is the next epoch's
    s.load_state_dict({"epoch": 4, "consumed": 30, "dataset_len": 30, "seed": 3, "shuffle": True})
    assert (len(s), list(s)) == (0, [])
    s.advance()
    assert (s.epoch, s.consumed) == (5, 4)


@pytest.mark.parametrize(
    "change",
    [
        {"dataset_len": 31},
        {"seed": 4},
        {"shuffle": False},
        {"consumed": 31},
        {"epoch": -1},
        {"consumed": None},
    ],
)
def test_load_refuses_another_stream_or_a_position_outside_it(change: dict[str, Any]) -> None:
    state = ElasticSampler(30, 2, 0, 2, seed=3).state_dict()
    state.update(change)
    if change.get("consumed", 0) is None:
        del state["consumed"]
    s = ElasticSampler(30, 2, 1, 5, seed=3)
    with pytest.raises(ValueError):
        s.load_state_dict(state)
    assert (s.epoch, s.consumed) == (0, 0)


def test_a_loop_that_never_marks_a_step_consumed_is_warned() -> None:
    s = ElasticSampler(6, 2, 0, 1)
    list(s)
    with pytest.warns(RuntimeWarning, match="no step was marked consumed"):
        list(s)
    s.advance()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s)


@pytest.mark.parametrize(
    ("kw", "bad"),
    [
        ({"dataset_len": -1}, "dataset_len"),
        ({"batch_size": 0}, "batch_size"),
        ({"world_size": 0}, "world_size"),
        ({"rank": 2}, "rank"),
    ],
)
def test_arguments_are_checked(kw: dict[str, int], bad: str) -> None:
    args = {"dataset_len": 10, "batch_size": 2, "rank": 0, "world_size": 2} | kw
    with pytest.raises(ValueError, match=bad):
        ElasticSampler(**args)


# -- the property: exactly once per epoch over random runs ----------------------------------

# One operation of a run: consume k steps, draw k batches ahead (in flight), resize the
# group to world size w and batch size b from the state (the in-flight batches are lost),
# or consume until the epoch ends.
_ops = st.one_of(
    st.tuples(st.just("consume"), st.integers(1, 4)),
    st.tuples(st.just("ahead"), st.integers(1, 3)),
    st.tuples(st.just("resize"), st.integers(1, 6), st.integers(1, 4)),
    st.tuples(st.just("finish_epoch")),
)


class _Run:
    """A group of samplers driven like a training loop, recording what each epoch consumed.

    With ``global_batch`` a step is each rank's ``accumulation`` micro-batches; a resize
    keeps the global batch (and the world size at most it)."""

    def __init__(
        self, n: int, batch: int, world: int, seed: int, drop_last: bool, global_batch: int | None = None
    ) -> None:
        self.n, self.seed, self.drop_last, self.global_batch = n, seed, drop_last, global_batch
        self.consumed: dict[int, list[int]] = {}  # epoch -> indices handed to the loop and consumed
        self.worlds: dict[int, list[tuple[int, int]]] = {}  # epoch -> (world, batch) at each step
        self.sizes: dict[int, list[int]] = {}  # epoch -> samples of each consumed step, all ranks
        self._form(batch, world, None)

    def _group(self, batch: int, world: int) -> list[ElasticSampler]:
        if self.global_batch is not None:
            world = min(world, self.global_batch)
        return group(
            self.n, batch, world, seed=self.seed, drop_last=self.drop_last, global_batch=self.global_batch
        )

    def _form(self, batch: int, world: int, state: dict[str, Any] | None) -> None:
        self.samplers = self._group(batch, world)
        for s in self.samplers:
            if state is not None:
                s.load_state_dict(state)
        self.its: list[Iterator[list[int]]] = [iter(s) for s in self.samplers]
        self.pending: list[list[list[int]]] = [[] for _ in self.samplers]  # drawn, not consumed

        self.check_len()

    def check_len(self) -> None:
        """``len`` is the number of steps an iteration from the position yields, on every rank."""
        s0 = self.samplers[0]
        fresh = self._group(s0.batch_size, s0.world_size)
        for s in fresh:
            s.load_state_dict(self.state())
        assert {len(s) for s in self.samplers} == {len(steps(fresh))}

    def state(self) -> dict[str, Any]:
        states = [s.state_dict() for s in self.samplers]
        assert all(st == states[0] for st in states), states
        return states[0]

    def _draw(self) -> bool:
        """Each rank draws one more batch; False at the end of the epoch (on every rank alike)."""
        got = [next(it, None) for it in self.its]
        assert len({b is None for b in got}) == 1, got
        if got[0] is None:
            return False
        for pend, b, s in zip(self.pending, got, self.samplers, strict=True):
            assert b is not None and len(b) <= s.batch_size
            pend.append(b)
        return True

    def consume_one(self) -> bool:
        """Consume the step at the position: each rank's ``accumulation`` micro-batches."""
        count = self.samplers[0].accumulation
        assert {s.accumulation for s in self.samplers} == {count}
        while len(self.pending[0]) < count:
            if not self._draw():
                # the epoch's iteration ended; its last step was consumed, so a new one starts the next
                assert not self.pending[0]
                self.its = [iter(s) for s in self.samplers]
                self.check_len()
                return False
        s0 = self.samplers[0]
        epoch = s0.epoch
        self.worlds.setdefault(epoch, []).append((s0.world_size, s0.batch_size))
        step: list[int] = []
        for pend, s in zip(self.pending, self.samplers, strict=True):
            for _ in range(count):
                step.extend(pend.pop(0))
            s.advance()
        self.consumed.setdefault(epoch, []).extend(step)
        self.sizes.setdefault(epoch, []).append(len(step))
        # the position is exactly the count of samples the loop consumed in the epoch
        state = self.state()
        if state["epoch"] == epoch:
            assert state["consumed"] == len(self.consumed[epoch])
        else:
            assert (state["epoch"], state["consumed"]) == (epoch + 1, 0)
        return True

    def apply(self, op: tuple[Any, ...]) -> None:
        if op[0] == "consume":
            for _ in range(int(op[1])):
                self.consume_one()
        elif op[0] == "ahead":
            for _ in range(int(op[1])):
                self._draw()
        elif op[0] == "resize":
            self._form(int(op[2]), int(op[1]), self.state())
        else:
            # (an epoch with no step at all, drop_last's case when the dataset is smaller than a
            # step, ends only by set_epoch: the iteration ends without moving the position)
            epoch = self.samplers[0].epoch
            while self.samplers[0].epoch == epoch and self.consume_one():
                pass

    def check(self) -> None:
        for epoch, got in self.consumed.items():
            counts = Counter(got)
            assert all(0 <= i < self.n for i in counts), got
            assert max(counts.values(), default=1) == 1, f"epoch {epoch}: repeated {counts.most_common(3)}"
            finished = epoch < self.samplers[0].epoch
            if finished and not self.drop_last:
                assert len(got) == self.n, f"epoch {epoch}: {self.n - len(got)} indices never yielded"
            if finished and self.drop_last:
                world, batch = self.worlds[epoch][-1]
                full = self.global_batch or world * batch
                assert self.n - len(got) < full or self.n < full
            if self.global_batch is not None:
                # every step of the epoch but its last took the global batch, at any world size
                assert all(k == self.global_batch for k in self.sizes.get(epoch, [])[:-1]), self.sizes[epoch]
            # what was consumed is a prefix of the epoch's stream, in order
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            assert got == torch.randperm(self.n, generator=g).tolist()[: len(got)]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 60),
    batch=st.integers(1, 5),
    world=st.integers(1, 6),
    global_batch=st.one_of(st.none(), st.integers(1, 14)),
    seed=st.integers(0, 2**31),
    drop_last=st.booleans(),
    ops=st.lists(_ops, min_size=1, max_size=25),
)
def test_every_index_is_consumed_exactly_once_per_epoch_across_resizes(
    n: int,
    batch: int,
    world: int,
    global_batch: int | None,
    seed: int,
    drop_last: bool,
    ops: list[tuple[Any, ...]],
) -> None:
    """With a ``global_batch`` also: every step of an epoch but its last takes exactly it,
    at whatever world size the group has then."""
    run = _Run(n, batch, world, seed, drop_last, global_batch)
    for op in ops:
        run.apply(op)
    run.check()


@settings(max_examples=100, deadline=None)
@given(world=st.integers(1, 8), batch=st.integers(2, 6), extra=st.integers(0, 200), start=st.integers(0, 200))
def test_a_group_that_keeps_its_size_never_gets_an_empty_batch(
    world: int, batch: int, extra: int, start: int
) -> None:
    n = world + extra  # at least one sample per rank
    samplers = group(n, batch, world, seed=2)
    for s in samplers:
        s.load_state_dict(s.state_dict() | {"consumed": min(start, n - world) // world * world})
    assert all(0 < len(b) <= batch for step in steps(samplers) for b in step)


# -- behind a real prefetching DataLoader ---------------------------------------------------


class _Indices(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class _Counting(ElasticSampler):
    """Counts the batches its iterations handed out (to see the DataLoader run ahead)."""

    drawn = 0

    def __iter__(self) -> Iterator[list[int]]:
        for b in super().__iter__():
            self.drawn += 1
            yield b


def _loaders(n: int, batch: int, world: int, state: dict[str, Any] | None) -> list[DataLoader[int]]:
    loaders = []
    for r in range(world):
        s = _Counting(n, batch, r, world, seed=11)
        if state is not None:
            s.load_state_dict(state)
        loaders.append(DataLoader(_Indices(n), batch_sampler=s, num_workers=2, prefetch_factor=2))
    return loaders


def _sampler(loader: DataLoader[int]) -> _Counting:
    s = loader.batch_sampler
    assert isinstance(s, _Counting)
    return s


def _tracked(loaders: list[DataLoader[int]]) -> Iterator[tuple[torch.Tensor, ...]]:
    """Every rank's next batch at once, through ``track``: the ranks in lockstep."""
    samplers = [_sampler(ld) for ld in loaders]
    return zip(*(s.track(ld) for s, ld in zip(samplers, loaders, strict=True)), strict=True)


def test_prefetching_dataloader_resumes_at_another_world_size_without_loss_or_repeat() -> None:
    n = 101
    seen: list[int] = []
    # a group of 2 consumes 5 steps while its loaders' workers fetch ahead, then stops
    first = _loaders(n, 4, 2, None)
    for k, step in enumerate(_tracked(first), start=1):
        seen += [i for b in step for i in b.tolist()]
        if k == 5:
            break
    samplers = [_sampler(ld) for ld in first]
    assert all(s.drawn > 5 for s in samplers), "the loader did not run ahead"
    state = samplers[0].state_dict()
    assert all(s.state_dict() == state for s in samplers)
    assert state["consumed"] == 5 * 2 * 4
    del first  # the batches in flight go with the loaders, as with a crashed group

    # a group of 3 with another batch size finishes the epoch and runs the next one
    second = _loaders(n, 3, 3, state)
    for step in _tracked(second):
        seen += [i for b in step for i in b.tolist()]
    assert sorted(seen) == list(range(n))
    s0 = _sampler(second[0])
    assert (s0.epoch, s0.consumed) == (1, 0)
    epoch1 = [i for step in _tracked(second) for b in step for i in b.tolist()]
    assert sorted(epoch1) == list(range(n)) and epoch1 != seen


def test_track_refuses_a_loader_over_another_sampler() -> None:
    s = ElasticSampler(10, 2, 0, 1)
    other = DataLoader(_Indices(10), batch_sampler=ElasticSampler(10, 2, 0, 1))
    with pytest.raises(ValueError, match="batch_sampler"):
        next(s.track(other))


# -- with torch.distributed.checkpoint, saved at one world size and loaded at another -------


def _group_run(mode: str, world: int, tmp: Path, *args: str) -> list[dict[str, Any]]:
    init = f"file://{tmp}/init_{mode}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPTS / "sampler_dcp_worker.py"),
                mode,
                "--init",
                init,
                "--ckpt",
                str(tmp / "ckpt"),
                "--out",
                str(tmp),
                *args,
            ],
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
    return [json.loads((tmp / f"{mode}_rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_dcp_checkpoint_saved_by_two_ranks_resumes_three(tmp_path: Path) -> None:
    saved = _group_run("save", 2, tmp_path, "--steps", "4")
    state = saved[0]["state"]
    assert all(rec["state"] == state for rec in saved)
    assert state == {"epoch": 0, "consumed": 4 * 2 * 3, "dataset_len": 50, "seed": 7, "shuffle": True}
    loaded = _group_run("load", 3, tmp_path)
    # every rank of the new group reads the same position, through the Stateful and the plain dict
    assert all(rec["state"] == state and rec["plain_state"] == state for rec in loaded)
    before = [i for rec in saved for b in rec["consumed_batches"] for i in b]
    after = [i for rec in loaded for b in rec["rest"] for i in b]
    assert sorted(before + after) == list(range(50))


# -- in a torch-only image, through the injected agent ---------------------------------------


@pytest.mark.slow
def test_injected_agent_brings_kelastic_data_to_a_torch_only_python(tmp_path: Path) -> None:
    from kelastic.agent import contract
    from kelastic.agent.inject import install
    from kelastic.localcluster.kubelet.images import torch_environment

    python = torch_environment(tmp_path / "venv")
    install(tmp_path / "agent")
    program = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(tmp_path / 'agent' / contract.INJECT_LIB)!r})\n"
        "from kelastic.data import ElasticSampler\n"
        "s = ElasticSampler(10, 2, 1, 2, seed=3)\n"
        "print(json.dumps([list(s), ElasticSampler.__module__]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run([str(python), "-c", program], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [list(ElasticSampler(10, 2, 1, 2, seed=3)), "kelastic.agent.data"]
