"""Samplers that shard a data set over ranks."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler


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
