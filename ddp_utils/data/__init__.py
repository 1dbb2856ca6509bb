"""Data for training and evaluation; ``build_data`` and ``build_eval_data`` are the front door.

Each data option's schema names its family module (``ddp_utils.data.registry``), which builds
its loaders with one set of guarantees (DistributedSampler's indices, exact mid-epoch resume,
every sample exactly once per epoch and in evaluation, at any world size):
- ``in_memory`` (``digits``, ``synthetic``, ``mnist``, ...): decoded once into uint8 tensors
  that the tensor loader indexes on the device (``builtin`` decodes them);
- ``streamed`` (``imagefolder``, ``custom``): images read and decoded in DataLoader workers,
  transformed per sample with a seed of (seed, epoch, index);
- ``segmentation`` (``segfolder``, ``voc``, ``digits_seg``, ``mnist_seg``): image and mask
  pairs through joint transforms, seeded the same way;
- ``tokens`` and ``pystdlib``: windows of token ids gathered from memory-mapped files,
  shuffled and sharded by the same resumable sampler.
Image batches stay uint8 until they reach the device, where ``Preprocess`` normalises them.
"""

from __future__ import annotations

from typing import Any

from ddp_utils.config import DataConfig
from ddp_utils.data.bundle import DataBundle, EvalData, Unit
from ddp_utils.data.images.builtin import load_split
from ddp_utils.data.images.preprocess import Preprocess
from ddp_utils.data.loaders import close_loader
from ddp_utils.data.registry import family_of
from ddp_utils.data.samplers import BAD_LABEL, IGNORE_LABEL
from ddp_utils.dist import Runtime

__all__ = [
    "BAD_LABEL",
    "IGNORE_LABEL",
    "DataBundle",
    "EvalData",
    "Preprocess",
    "Unit",
    "build_data",
    "build_eval_data",
    "close_loader",
    "load_split",
    "offered_by_data",
    "resolve_data",
]


def resolve_data(cfg: DataConfig, rt: Runtime) -> DataConfig:
    """Every rank: ``cfg`` with what only the data can say filled in (token data's
    vocab_size, dtype and num_classes; data=pystdlib prepared first)."""
    resolve = getattr(family_of(cfg), "resolve", None)
    return cfg if resolve is None else resolve(cfg, rt)


def offered_by_data(cfg: DataConfig) -> dict[str, Any]:
    """What a task's ``_target_`` is offered of the data (where its signature takes it): the
    sizes, and what the family adds (token data: the bytes each id stands for)."""
    offered = getattr(family_of(cfg), "offered", None)
    return cfg.sizes() | (offered(cfg) if offered is not None else {})


def build_data(
    cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str = False
) -> DataBundle:
    """Every rank: the training and validation loaders of ``data=...`` and their preprocessing
    (``cfg`` resolved by ``resolve_data``)."""
    return family_of(cfg).build(cfg, rt, seed, channels_last)


def build_eval_data(
    cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str = False
) -> EvalData:
    """Every rank: the loader of ``data.split`` sharded exactly, its preprocessing, classes."""
    return family_of(cfg).build_eval(cfg, rt, seed, channels_last)
