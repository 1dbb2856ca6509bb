"""Loaders: batches indexed on the device for in-memory sets, DataLoader workers for streams."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ddp_utils.config import DataConfig
from ddp_utils.data.images.builtin import ImageTensorDataset
from ddp_utils.data.samplers import (
    IGNORE_LABEL,
    SENTINEL,
    EpochTagged,
    ResumableDistributedSampler,
    eval_sampler,
    training_sampler,
)
from ddp_utils.dist import Runtime

MAX_AUTO_WORKERS = 16


class TensorLoader:
    """Batches by indexing tensors that live on the training device: no workers, no collation.

    It takes the same sampler as a DataLoader would (so each rank gets the same indices in
    the same order) and turns the epoch's index list into one device tensor; each batch is
    then a gather on the device. Padding markers (negative indices) get the ignored label.
    """

    def __init__(self, ds: ImageTensorDataset, sampler: Sampler, batch_size: int, device) -> None:
        self.dataset, self.sampler, self.batch_size = ds, sampler, batch_size
        self.images = ds.images.to(device)
        self.labels = ds.labels.to(device)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        real = (order >= 0).to(self.images.device, non_blocking=True)
        index = torch.where(order >= 0, order, ~order).to(self.images.device, non_blocking=True)
        for start in range(0, len(order), self.batch_size):
            idx = index[start : start + self.batch_size]
            labels = torch.where(
                real[start : start + self.batch_size], self.labels[idx], IGNORE_LABEL
            )
            yield self.images[idx], labels


def default_num_workers(local_world_size: int, cpus_per_task: int | None = None) -> int:
    """``data.num_workers=null``: the cores this process may use, less one for the training
    process itself; at least 1. Under torchrun the node's ranks share the cores they see;
    a SLURM task (srun, one process per task) has ``cpus_per_task`` of its own."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    share = min(cores, cpus_per_task) if cpus_per_task else cores // local_world_size
    return max(1, min(MAX_AUTO_WORKERS, share - 1))


def collate(items: list[tuple[Any, Any]]) -> Any:
    """DataLoader's ``default_collate``, except that per-sample dict targets (boxes of
    different lengths) stay a list of dicts, torchvision detection's layout, and their images
    a list where their sizes differ; a sentinel label among them (a padding duplicate, a
    skipped image) becomes ``{SENTINEL: label}``."""
    if not any(isinstance(target, Mapping) for _, target in items):
        return default_collate(items)
    images = [image for image, _ in items]
    if all(image.shape == images[0].shape for image in images):
        images = default_collate(images)  # else a list: detectors take images of any size
    return images, [t if isinstance(t, Mapping) else {SENTINEL: int(t)} for _, t in items]


def worker_loader(ds: Dataset, sampler: Sampler, cfg: DataConfig, rt: Runtime) -> DataLoader:
    """The standard DataLoader: worker processes, pinned memory on CUDA, prefetching.

    Its own generator keeps the DataLoader's base-seed draw off the global RNG, whose state
    checkpoints carry: with it, a resumed run draws exactly what an uninterrupted one does.
    """
    workers = cfg.num_workers
    if workers is None:
        workers = default_num_workers(rt.local_world_size, rt.cpus_per_task)
    return DataLoader(
        ds,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=rt.device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
        generator=torch.Generator().manual_seed(0),
        collate_fn=collate,
    )


def eval_shard_loader(ds: Dataset, cfg: DataConfig, rt: Runtime) -> DataLoader:
    """Workers over this rank's exact evaluation shard of ``ds``."""
    return worker_loader(ds, eval_sampler(len(ds), cfg, rt), cfg, rt)


def sharded_loaders(
    train_ds: Dataset,
    val_ds: Dataset,
    cfg: DataConfig,
    rt: Runtime,
    seed: int,
    source: object = None,
) -> tuple[DataLoader, DataLoader, ResumableDistributedSampler]:
    """The per-sample-seeded training loader (its keys carry the epoch), the exact
    validation loader, and the training sampler. A training ``source`` that reads in an order
    of its own (tar shards: by windows of shards) says so: ``epoch_order(seed, epoch)`` gives
    the epoch's permutation, ``prefetching(keys, seed)`` wraps the keys the workers get."""
    order = getattr(source, "epoch_order", None)
    sampler = training_sampler(len(train_ds), cfg, rt, seed, order=order)
    keys: Sampler = EpochTagged(sampler)
    if hasattr(source, "prefetching"):
        keys = source.prefetching(keys, seed)
    train = worker_loader(train_ds, keys, cfg, rt)
    return train, eval_shard_loader(val_ds, cfg, rt), sampler


def close_loader(loader: TensorLoader | DataLoader) -> None:
    """Stop a DataLoader's persistent workers now.

    Left to the interpreter's exit, every loader's workers are stopped one after the other
    during teardown, each waiting out its own timeout; the loader starts new workers if it is
    iterated again.
    """
    # DataLoader keeps an iterator only for persistent workers; a TensorLoader has none.
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()
        loader._iterator = None
