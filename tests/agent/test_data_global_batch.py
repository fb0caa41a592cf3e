"""``ElasticSampler(global_batch=G)``: the same samples per optimizer step at any world size.

Table tests pin how a step is cut (ranks' shares, micro-batches, the accumulation count, the
loss scale); an in-process simulation of DDP shows that the gradients, and so the training,
do not depend on the world size. The property test over random resizes is in
test_data_sampler.py (``_Run`` with a global batch); the real agents, gloo and a resize are in
tests/packaging/test_pkg_train_example.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from kelastic.data import ElasticSampler, MicroBatch


def group(n: int, micro: int, world: int, global_batch: int, **kw: Any) -> list[ElasticSampler]:
    return [ElasticSampler(n, micro, r, world, global_batch=global_batch, **kw) for r in range(world)]


def micro_batches(samplers: list[ElasticSampler]) -> list[list[list[int]]]:
    """The next optimizer step: each rank's micro-batches, by rank (consumed afterwards)."""
    count = samplers[0].accumulation
    step = [[b for _, b in zip(range(count), iter(s), strict=False)] for s in samplers]
    for s in samplers:
        s.advance()
    return step


@pytest.mark.parametrize(
    ("n", "micro", "world", "global_batch", "expected"),
    [
        # 8 per step: 2 ranks of 4 in 2 micro-batches of 2, or 4 ranks of 2 in one
        (8, 2, 2, 8, [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]),
        (8, 2, 4, 8, [[[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]]),
        # 3 ranks share 8 as 3/3/2, each in 2 micro-batches (the count is the same on every rank)
        (8, 2, 3, 8, [[[[0, 1], [2]], [[3, 4], [5]], [[6], [7]]]]),
        # the epoch's last step is short (drop_last=False): 10 = 8 + 2
        (10, 4, 1, 8, [[[[0, 1, 2, 3], [4, 5, 6, 7]]], [[[8, 9]]]]),
    ],
)
def test_a_step_takes_the_global_batch_cut_over_the_ranks_and_their_micro_batches(
    n: int, micro: int, world: int, global_batch: int, expected: list[list[list[list[int]]]]
) -> None:
    samplers = group(n, micro, world, global_batch, shuffle=False)
    assert {len(s) for s in samplers} == {sum(len(step[0]) for step in expected)}
    got = [micro_batches(samplers) for _ in expected]
    assert got == expected
    assert samplers[0].epoch == 1  # the last step consumed ended the epoch


def test_the_accumulation_count_follows_the_world_size_and_the_step_stays_the_same() -> None:
    for world, count in ((1, 8), (2, 4), (3, 3), (4, 2), (8, 1)):
        samplers = group(1000, 4, world, 32, seed=5)
        assert {s.accumulation for s in samplers} == {count}
        step = micro_batches(samplers)
        assert all(len(b) <= 4 for rank in step for b in rank)
        assert sorted(i for rank in step for b in rank for i in b) == sorted(
            torch.randperm(1000, generator=torch.Generator().manual_seed(5))[:32].tolist()
        )


def test_accumulate_says_where_each_micro_batch_sits_and_marks_the_step_at_its_last() -> None:
    s = ElasticSampler(10, 2, 1, 3, shuffle=False, global_batch=8)  # rank 1 of 3: 3 samples a step
    got = []
    for batch, info in s.accumulate(iter(s)):
        got.append((batch, info, s.consumed))
        if len(got) == 3:
            break
    (b0, m0, c0), (b1, m1, c1), (b2, m2, _) = got
    assert (b0, b1) == ([3, 4], [5]) and (m0.index, m0.count, m0.size, m0.step_samples) == (0, 2, 2, 8)
    assert not m0.last and m1.last and c0 == 0 and c1 == 8  # consumed as the last is handed out
    assert m0.scale == pytest.approx(2 * 3 / 8) and m1.scale == pytest.approx(1 * 3 / 8)
    # the epoch's short last step (2 samples over 3 ranks): rank 1 gets one
    assert b2 == [9] and (m2.count, m2.size, m2.step_samples) == (1, 1, 2)


def test_a_global_batch_smaller_than_the_world_is_refused_saying_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"global_batch \(3\) is smaller than the world size \(4\)"):
        ElasticSampler(100, 2, 0, 4, global_batch=3)


def test_without_a_global_batch_each_batch_is_a_whole_step() -> None:
    s = ElasticSampler(10, 2, 0, 2, shuffle=False)
    (batch, info) = next(s.accumulate(iter(s)))
    assert batch == [0, 1] and info == MicroBatch(0, 1, 2, 4, 2) and info.last and s.consumed == 4


# -- the training does not depend on the world size ----------------------------------------------


def train(world: int, steps: int, *, global_batch: int | None, per_rank: int = 4) -> list[float]:
    """Train a small MLP as ``world`` DDP ranks would (in one process: each rank's gradients
    accumulated over its micro-batches, then averaged over the ranks as DDP's all-reduce
    does); the mean loss over each step's samples. Without ``global_batch`` every rank takes
    ``per_rank`` samples a step, so the global batch follows the world size."""
    torch.manual_seed(0)
    data = torch.randn(600, 8, generator=torch.Generator().manual_seed(1))
    target = data @ torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    momentum = [torch.zeros_like(p) for p in model.parameters()]  # SGD with momentum, by hand
    samplers = [
        ElasticSampler(len(data), per_rank, r, world, seed=3, global_batch=global_batch) for r in range(world)
    ]
    streams = [s.accumulate(iter(s)) for s in samplers]
    losses = []
    for _ in range(steps):
        averaged = [torch.zeros_like(p) for p in model.parameters()]
        total = 0.0
        for stream in streams:
            while True:
                idx, micro = next(stream)
                x, y = data[idx], target[idx]
                loss = nn.functional.mse_loss(model(x), y) * micro.scale
                grads = torch.autograd.grad(loss, list(model.parameters()))
                for a, g in zip(averaged, grads, strict=True):
                    a += g / world
                total += float(loss.detach()) / world
                if micro.last:
                    break
        with torch.no_grad():
            for p, m, g in zip(model.parameters(), momentum, averaged, strict=True):
                p.sub_(m.mul_(0.9).add_(g), alpha=0.05)
        losses.append(total)
    return losses


def test_with_a_global_batch_the_loss_curve_is_the_same_at_every_world_size() -> None:
    """Each step averages the gradients of the same 24 samples, only summed in another order
    (per rank, per micro-batch, then over the ranks), so float32 rounding is all that differs:
    a few units in the last place (2**-23, about 1.2e-7, relative) per step, which 15 steps of
    SGD do not grow past 1e-5 (measured: about 3e-7)."""
    curves = {w: train(w, 15, global_batch=24, per_rank=5) for w in (1, 3, 4)}
    for w, curve in curves.items():
        assert curve == pytest.approx(curves[1], rel=1e-5, abs=0), w
    # without it the global batch follows the world size, and so does the training (measured: 5x)
    fixed_per_rank = {w: train(w, 15, global_batch=None, per_rank=6) for w in (2, 4)}
    gap = max(abs(a - b) / b for a, b in zip(fixed_per_rank[2], fixed_per_rank[4], strict=True))
    assert gap > 1e-2
