"""Data for training and evaluation; ``build_data`` and ``build_eval_data`` are the front door.

Two paths, one set of guarantees (DistributedSampler's indices, exact mid-epoch resume,
every sample exactly once per epoch and in evaluation, at any world size):
- in memory (``builtin``): the small built-in sets, decoded once into uint8 tensors that the
  tensor loader indexes on the device (the fastest path for them; ``data.loader=auto``);
- streamed (``imagefolder``, ``custom``): images read and decoded in DataLoader workers,
  transformed per sample with a seed of (seed, epoch, index);
- segmentation (``segfolder``, ``voc``, ``digits_seg``, ``mnist_seg``): image and mask pairs
  through joint transforms, seeded the same way (``ddp_utils.data.segmentation``);
- tokens (``tokens``, ``pystdlib``): windows of token ids gathered from memory-mapped files
  (``ddp_utils.data.tokens``), shuffled and sharded by the same resumable sampler.
Batches stay uint8 until they reach the device, where ``Preprocess`` normalises them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.data import DataLoader, Sampler

from ddp_utils.config import DataConfig, SegmentationData, StreamedData, TokenData
from ddp_utils.data.builtin import ImageTensorDataset, load_split
from ddp_utils.data.loaders import TensorLoader, close_loader, worker_loader
from ddp_utils.data.preprocess import Preprocess
from ddp_utils.data.samplers import (
    BAD_LABEL,
    IGNORE_LABEL,
    EvalShardSampler,
    ResumableDistributedSampler,
    training_sampler,
)
from ddp_utils.dist import Runtime, local_main_first

__all__ = [
    "BAD_LABEL",
    "IGNORE_LABEL",
    "DataBundle",
    "Preprocess",
    "build_data",
    "build_eval_data",
    "close_loader",
    "load_split",
    "offered_by_data",
    "resolve_data",
]


@dataclass
class DataBundle:
    train: TensorLoader | DataLoader
    val: TensorLoader | DataLoader
    train_sampler: ResumableDistributedSampler
    preprocess_train: nn.Module
    preprocess_eval: nn.Module
    classes: list[str] | None = None  # class names, where the source has them
    tokenizer: dict[str, Any] | None = None  # token data's tokenizer spec (generate.py's)
    tokens_per_sample: int | None = None  # token data: a window's targets (block_size)

    def close(self) -> None:
        """Stop the loaders' worker processes (a loader iterated again starts new ones)."""
        close_loader(self.train)
        close_loader(self.val)


def in_memory_loader(
    ds: ImageTensorDataset, sampler: Sampler, cfg: DataConfig, rt: Runtime
) -> TensorLoader | DataLoader:
    """``data.loader``: ``tensor`` (``auto``: batches indexed on the device) or ``torch``."""
    if cfg.loader in ("auto", "tensor"):
        return TensorLoader(ds, sampler, cfg.batch_size, rt.device)
    return worker_loader(ds, sampler, cfg, rt)


def resolve_data(cfg: DataConfig, rt: Runtime) -> DataConfig:
    """Every rank: ``cfg`` with what only the data can say filled in (token data's
    vocab_size, dtype and num_classes; data=pystdlib prepared first)."""
    if isinstance(cfg, TokenData):
        from ddp_utils.data.tokens import resolve_tokens

        return resolve_tokens(cfg, rt)
    return cfg


def offered_by_data(cfg: DataConfig) -> dict[str, Any]:
    """What a task's ``_target_`` is offered of the data (where its signature takes it): the
    sizes, and for token data the bytes each id stands for (None where unknown)."""
    offered = cfg.sizes()
    if isinstance(cfg, TokenData):
        from ddp_utils.data.tokens import read_meta

        offered["token_bytes"] = read_meta(cfg).token_bytes
    return offered


def token_bundle(cfg: TokenData, rt: Runtime, seed: int) -> DataBundle:
    from ddp_utils.data.tokens import read_meta, token_loaders

    train, val, sampler = token_loaders(cfg, rt, seed)
    return DataBundle(
        train,
        val,
        sampler,
        nn.Identity(),
        nn.Identity(),
        tokenizer=read_meta(cfg).tokenizer,
        tokens_per_sample=cfg.block_size,
    )


def build_data(
    cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str = False
) -> DataBundle:
    """Every rank: the training and validation loaders of ``data=...`` and their preprocessing
    (``cfg`` resolved by ``resolve_data``)."""
    classes = None
    if isinstance(cfg, TokenData):
        return token_bundle(cfg, rt, seed)
    if isinstance(cfg, SegmentationData):
        from ddp_utils.data.segmentation import seg_loaders  # joint image + mask transforms

        train, val, sampler, classes = seg_loaders(cfg, rt, seed)
        augment_on_device = False
    elif isinstance(cfg, StreamedData):
        from ddp_utils.data.streamed import streamed_loaders  # torchvision: streamed sets only

        train, val, sampler, classes = streamed_loaders(cfg, rt, seed)
        augment_on_device = False  # done per sample in the workers
    else:
        with local_main_first(rt):
            train_ds, val_ds = load_split(cfg, "train"), load_split(cfg, "val")
        sampler = training_sampler(len(train_ds), cfg, rt, seed)
        train = in_memory_loader(train_ds, sampler, cfg, rt)
        val = in_memory_loader(
            val_ds, EvalShardSampler(len(val_ds), rt.world_size, rt.rank), cfg, rt
        )
        augment_on_device = cfg.augment
    return DataBundle(
        train=train,
        val=val,
        train_sampler=sampler,
        preprocess_train=Preprocess(cfg, augment_on_device, channels_last).to(rt.device),
        preprocess_eval=Preprocess(cfg, False, channels_last).to(rt.device),
        classes=classes,
    )


def build_eval_data(
    cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str = False
) -> tuple[TensorLoader | DataLoader, nn.Module, list[str] | None]:
    """Every rank: the loader of ``data.split`` sharded exactly, its preprocessing, classes."""
    if isinstance(cfg, TokenData):
        from ddp_utils.data.tokens import eval_loader

        return eval_loader(cfg, rt, cfg.split), nn.Identity(), None
    if isinstance(cfg, SegmentationData):
        from ddp_utils.data.segmentation import seg_eval_loader

        loader, classes = seg_eval_loader(cfg, rt, seed)
    elif isinstance(cfg, StreamedData):
        from ddp_utils.data.streamed import streamed_eval_loader

        loader, classes = streamed_eval_loader(cfg, rt, seed)
    else:
        with local_main_first(rt):
            ds, classes = load_split(cfg, cfg.split), None
        loader = in_memory_loader(ds, EvalShardSampler(len(ds), rt.world_size, rt.rank), cfg, rt)
    return loader, Preprocess(cfg, False, channels_last).to(rt.device), classes
