"""Samplers that shard a data set over ranks, and the labels that mark samples not to count."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler

from ddp_utils.config import DataConfig
from ddp_utils.dist import Runtime

IGNORE_LABEL = -100  # cross_entropy's default ignore_index: a padding duplicate
BAD_LABEL = -101  # an image that could not be read, skipped under data.skip_bad_images=true
# A per-sample dict target (boxes) that stands for one of those: {SENTINEL: IGNORE_LABEL}
SENTINEL = "ddp_recipes_sentinel"


class EvalShardSampler(Sampler[int]):
    """Every index goes to exactly one rank, in whole canonical batches: no padding, no dropping.

    The data set's order is cut into batches of ``batch_size`` (the last may be short), and
    batch ``k`` goes to rank ``k % W``. Each batch then holds the same samples at any world
    size, so each sample's output (and a batch's sum) is the one-process number, to the last
    digit; the evaluation puts the batches' results back in batch order
    (``ddp_utils.evaluation``). DistributedSampler instead pads the set until its length divides
    by the world size, so duplicates are counted twice. Ranks' batch counts differ by at most
    one: an evaluation loop must not put a collective inside its per-batch loop.
    """

    def __init__(self, length: int, world_size: int, rank: int, batch_size: int = 1) -> None:
        assert 0 <= rank < world_size, f"rank {rank} outside world size {world_size}"
        assert batch_size >= 1, f"batch_size {batch_size}"
        self.length, self.world_size, self.rank = length, world_size, rank
        self.batch_size = batch_size

    def batches(self) -> range:
        """The canonical batch numbers this rank evaluates, in its order."""
        return range(self.rank, math.ceil(self.length / self.batch_size), self.world_size)

    def batch_sizes(self) -> list[int]:
        """The sizes of this rank's batches, in its order (the data set's last may be short)."""
        b = self.batch_size
        return [min((k + 1) * b, self.length) - k * b for k in self.batches()]

    def __iter__(self) -> Iterator[int]:
        b = self.batch_size
        for k in self.batches():
            yield from range(k * b, min((k + 1) * b, self.length))

    def __len__(self) -> int:
        return sum(self.batch_sizes())


def eval_sampler(length: int, cfg: DataConfig, rt: Runtime) -> EvalShardSampler:
    """This rank's exact evaluation shard, in canonical batches of ``data.batch_size``."""
    return EvalShardSampler(length, rt.world_size, rt.rank, cfg.batch_size)


def pad_marker(index: int) -> int:
    """Encode a padding duplicate: the data set returns the sample with an ignored label."""
    return ~index


class ResumableDistributedSampler(Sampler[int]):
    """DistributedSampler's shuffle and stride, resumable from any point of an epoch.

    An epoch's order is ``randperm(n)`` seeded by ``seed + epoch``, as in DistributedSampler.
    ``set_epoch(epoch, start)`` skips the first ``start`` positions of that order (the samples
    all ranks consumed before an interruption) and shards the rest over the current ranks with
    DistributedSampler's stride: rank ``r`` takes positions ``r, r + W, ...``. With
    ``start=0`` each rank gets exactly DistributedSampler's indices. The padding that makes
    the shards equal is yielded as ``pad_marker(i)``: the sample is computed but its label is
    ignored, so every sample counts exactly once per epoch, whatever the world size.

    ``order(seed, epoch)`` replaces ``randperm`` with the data's own permutation (sharded data
    shuffles within windows of shards).

    ``drop_last_of=B`` (``data.drop_last``, the default for training) instead ends the epoch
    at the last whole batch of ``B`` on every rank: the positions past a multiple of
    ``B x world size`` are skipped (up to ``B x world size - 1`` random samples an epoch, as
    DataLoader's ``drop_last``), so every batch is full and no BatchNorm layer in training
    mode gets a batch of one. A rest shorter than one such global batch is kept (padded).
    """

    def __init__(
        self,
        length: int,
        world_size: int,
        rank: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last_of: int | None = None,
        order: Callable[[int, int], list[int]] | None = None,
    ) -> None:
        assert 0 <= rank < world_size, f"rank {rank} outside world size {world_size}"
        self.length, self.world_size, self.rank = length, world_size, rank
        self.seed, self.shuffle, self.drop_last_of = seed, shuffle, drop_last_of
        self.order = order
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        assert 0 <= start <= self.length, f"start {start} outside the epoch of {self.length}"
        self.epoch, self.start = epoch, start

    def epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        if self.order is not None:  # the data's own permutation (sharded data: by window)
            return self.order(self.seed, self.epoch)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=g).tolist()

    def kept(self, start: int) -> int:
        """How many positions from ``start`` on this epoch trains on (all but dropped ones)."""
        rest, whole = self.length - start, (self.drop_last_of or 0) * self.world_size
        return rest // whole * whole if whole and rest >= whole else rest

    def shard_length(self, start: int) -> int:
        """Each rank's sample count from epoch position ``start`` to the epoch's end."""
        return math.ceil(self.kept(start) / self.world_size)

    def __iter__(self) -> Iterator[int]:
        rest = self.epoch_order()[self.start : self.start + self.kept(self.start)]
        pad = -len(rest) % self.world_size
        if rest and pad:
            repeats = rest * math.ceil(pad / len(rest))
            rest = rest + [pad_marker(i) for i in repeats[:pad]]
        return iter(rest[self.rank :: self.world_size])

    def __len__(self) -> int:
        return self.shard_length(self.start)

    def consumed(self, batches: int, batch_size: int) -> int:
        """The epoch position after every rank has taken ``batches`` batches from here: the
        epoch's length once they are all taken (dropped positions are passed, not trained)."""
        if batches * batch_size >= len(self):
            return self.length
        return self.start + batches * batch_size * self.world_size

    def trained_through(self, position: int) -> int:
        """``position`` less the dropped positions before it (for the samples counted)."""
        return min(position, self.start + self.kept(self.start))


def training_sampler(
    length: int,
    cfg: DataConfig,
    rt: Runtime,
    seed: int,
    order: Callable[[int, int], list[int]] | None = None,
) -> ResumableDistributedSampler:
    """The training sampler of ``length`` samples for ``data=...`` on this rank; ``order(seed,
    epoch)``: the data's own epoch permutation (else ``randperm``)."""
    # Epochs end at a whole optimizer step's samples on every rank: with a global batch,
    # at a multiple of it, so an epoch has the same steps at any world size.
    per_step = cfg.global_batch_size // rt.world_size if cfg.global_batch_size else cfg.batch_size
    drop = per_step if cfg.drop_last else None
    return ResumableDistributedSampler(length, rt.world_size, rt.rank, seed=seed,
                                       drop_last_of=drop, order=order)  # fmt: skip


class EpochTagged(Sampler[tuple[int, int]]):
    """Yields ``(epoch, index)`` for each index of a ``ResumableDistributedSampler``.

    DataLoader workers hold copies of the data set, so they cannot learn the epoch from a
    ``set_epoch`` call in the main process; the key they are handed carries it instead, and
    each sample's augmentation is seeded from (seed, epoch, index) alone.
    """

    def __init__(self, sampler: ResumableDistributedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, i) for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)
