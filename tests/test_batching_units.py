"""Which samples each rank and step takes: the exact evaluation shards, the global batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.runs import compose_config
from torch.utils.data import DistributedSampler

from ddp_utils.config import (
    ConfigError,
    DigitsData,
)
from ddp_utils.data.samplers import EvalShardSampler
from ddp_utils.dist import (
    Runtime,
)


@pytest.mark.parametrize("length", [0, 1, 7, 2000, 2001])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_eval_sampler_gives_every_index_to_exactly_one_rank(length, world_size, batch):
    samplers = [EvalShardSampler(length, world_size, r, batch) for r in range(world_size)]
    shards = [list(s) for s in samplers]
    flat = sorted(i for shard in shards for i in shard)
    assert flat == list(range(length))
    assert [len(s) for s in samplers] == [len(s) for s in shards]
    # Whole canonical batches: batch k (the data set's k-th run of `batch`) on rank k % W, so a
    # loader batching each shard by `batch` sees world size 1's batches.
    for r, sampler in enumerate(samplers):
        batches = [shards[r][i : i + batch] for i in range(0, len(shards[r]), batch)]
        assert batches == [list(range(k * batch, min((k + 1) * batch, length)))
                           for k in sampler.batches()]  # fmt: skip
        assert all(k % world_size == r for k in sampler.batches())


def test_distributed_sampler_pads_which_is_why_eval_does_not_use_it():
    counted = sum(len(DistributedSampler(range(2000), 3, r, shuffle=False)) for r in range(3))
    assert counted == 2001


@pytest.mark.parametrize(
    ("world_size", "cap", "want"),
    [(1, 100, (60, 2)), (1, 120, (120, 1)), (2, 100, (60, 1)), (3, 100, (40, 1)), (4, 100, (30, 1)),
     (2, 32, (30, 2)), (1, 7, (6, 20)), (8, 16, (15, 1))],
)  # fmt: skip
def test_a_global_batch_is_split_with_the_fewest_accumulation_steps(world_size, cap, want):
    from ddp_utils.train.state import split_global_batch

    batch, accum = split_global_batch(120, world_size, cap)
    assert (batch, accum) == want and batch * world_size * accum == 120 and batch <= cap


def test_a_global_batch_the_world_size_does_not_divide_is_refused_naming_values():
    from ddp_utils.train.state import split_global_batch

    with pytest.raises(ConfigError, match=r"data.global_batch_size=119 or 126"):
        split_global_batch(125, 7, 100)


def test_the_global_batch_sets_batch_and_accumulation_and_refuses_an_explicit_one():
    from ddp_utils.train.state import resolve_auto

    cfg = compose_config("data.global_batch_size=120", "data.batch_size=32",
                         "trainer.precision=32")  # fmt: skip
    rt = Runtime(0, 0, 2, 2, torch.device("cpu"), "gloo")
    resolved = resolve_auto(cfg, rt)
    assert (resolved.data.batch_size, resolved.trainer.grad_accum_steps) == (30, 2)
    assert resolved.data.global_batch_size == 120
    both = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, grad_accum_steps=3))
    with pytest.raises(ConfigError, match=r"drop trainer.grad_accum_steps=3"):
        resolve_auto(both, rt)


def test_with_a_global_batch_each_step_takes_the_same_samples_at_any_world_size():
    """Global batch k is positions [kG, (k+1)G) of the epoch's order whatever the world size,
    an epoch has the same steps, and a resume at another world size from a step boundary
    continues with the same global batches."""
    from ddp_utils.data.samplers import training_sampler

    def steps(world_size: int, start: int = 0) -> list[set[int]]:
        batch, accum = {2: (30, 2), 3: (40, 1), 4: (30, 1)}[world_size]
        cfg = DigitsData(batch_size=batch, global_batch_size=120)
        shards = []
        for rank in range(world_size):
            rt = Runtime(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")
            sampler = training_sampler(1797, cfg, rt, seed=3)
            sampler.set_epoch(1, start)
            shards.append(list(sampler))
        per_step = batch * accum
        assert all(len(s) % per_step == 0 for s in shards)
        return [set().union(*(s[k * per_step:(k + 1) * per_step] for s in shards))
                for k in range(len(shards[0]) // per_step)]  # fmt: skip

    two = steps(2)
    assert len(two) == 1797 // 120 and all(len(s) == 120 for s in two)
    assert steps(3) == two == steps(4)
    assert steps(3, start=5 * 120) == two[5:]
