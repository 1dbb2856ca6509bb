"""Samplers that shard a data set over ranks, and the labels that mark samples not to count."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

IGNORE_LABEL = -100  # cross_entropy's default ignore_index: a padding duplicate
BAD_LABEL = -101  # an image that could not be read, skipped under data.skip_bad_images=true


class EvalShardSampler(Sampler[int]):
    """Every index goes to exactly one rank: no padding, no dropping.

    DistributedSampler pads the set until its length divides by the world size, so the padded
    duplicates are counted twice and the metrics change with the number of processes. Here
    rank ``r`` takes ``r, r + W, r + 2W, ...``; shard sizes differ by at most one, so an
    evaluation loop must not put a collective inside its per-batch loop.
    """

    def __init__(self, length: int, world_size: int, rank: int) -> None:
        assert 0 <= rank < world_size, f"rank {rank} outside world size {world_size}"
        self.length, self.world_size, self.rank = length, world_size, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))


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
    """

    def __init__(
        self, length: int, world_size: int, rank: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        assert 0 <= rank < world_size, f"rank {rank} outside world size {world_size}"
        self.length, self.world_size, self.rank = length, world_size, rank
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        assert 0 <= start <= self.length, f"start {start} outside the epoch of {self.length}"
        self.epoch, self.start = epoch, start

    def epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        rest = self.epoch_order()[self.start :]
        pad = -len(rest) % self.world_size
        if rest and pad:
            repeats = rest * math.ceil(pad / len(rest))
            rest = rest + [pad_marker(i) for i in repeats[:pad]]
        return iter(rest[self.rank :: self.world_size])

    def __len__(self) -> int:
        return math.ceil((self.length - self.start) / self.world_size)

    def consumed(self, batches: int, batch_size: int) -> int:
        """The epoch position after every rank has taken ``batches`` batches from here."""
        return min(self.length, self.start + batches * batch_size * self.world_size)


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
