"""Per-sample transforms in the loader's workers, batched preprocessing on the device.

Streamed sources (image folders, custom sets) are transformed per sample with
``torchvision.transforms.v2`` on uint8 tensors, the classification references' presets:
training ``RandomResizedCrop`` + horizontal flip, evaluation ``Resize`` + ``CenterCrop``. The
random draws of a sample are a function of (seed, epoch, index) alone: each sample runs its
transform under its own RNG seed, so neither the number of workers, nor the world size, nor
a mid-epoch resume changes what a sample looks like. Normalisation stays on the device
(``ddp_utils.data.preprocess``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from ddp_utils.config import DataConfig
from ddp_utils.data.samplers import IGNORE_LABEL

INTERPOLATIONS = {
    "nearest": v2.InterpolationMode.NEAREST,
    "bilinear": v2.InterpolationMode.BILINEAR,
    "bicubic": v2.InterpolationMode.BICUBIC,
}


def resize_size(cfg: DataConfig) -> int:
    """``data.resize_size``, by default the references' ratio: image_size / 0.875."""
    return cfg.resize_size or round(cfg.image_size / 0.875)


def eval_transform(cfg: DataConfig) -> v2.Transform:
    mode = INTERPOLATIONS[cfg.interpolation]
    return v2.Compose(
        [v2.Resize(resize_size(cfg), interpolation=mode, antialias=True),
         v2.CenterCrop(cfg.image_size)]
    )  # fmt: skip


def auto_augment(cfg: DataConfig) -> list[v2.Transform]:
    mode = INTERPOLATIONS[cfg.interpolation]
    if cfg.auto_augment == "ta_wide":
        return [v2.TrivialAugmentWide(interpolation=mode)]
    if cfg.auto_augment == "ra":
        return [v2.RandAugment(interpolation=mode)]
    if cfg.auto_augment == "augmix":
        return [v2.AugMix(interpolation=mode)]
    return []


def train_transform(cfg: DataConfig) -> v2.Transform:
    """The references' training preset: ``RandomResizedCrop(train_crop_size)`` + flip
    (without ``data.augment``, the evaluation preset), then ``data.auto_augment`` and
    ``data.random_erase``, all on uint8 tensors."""
    mode = INTERPOLATIONS[cfg.interpolation]
    if cfg.augment:
        crop = cfg.train_crop_size or cfg.image_size
        steps = [v2.RandomResizedCrop(crop, interpolation=mode, antialias=True),
                 v2.RandomHorizontalFlip()]  # fmt: skip
    else:
        steps = [eval_transform(cfg)]
    steps += auto_augment(cfg)
    if cfg.random_erase > 0:
        steps.append(v2.RandomErasing(p=cfg.random_erase))
    return v2.Compose(steps)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed that depends on (seed, epoch, index) and nothing else."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeededTransform(Dataset):
    """A source of ``(uint8 CHW tensor, label)`` with a per-sample transform applied.

    A key is an index, or ``(epoch, index)`` from ``EpochTagged``; a negative index is a
    sampler's padding duplicate (its label is ignored). The transform runs under
    ``fork_rng`` with the sample's own seed, so the caller's RNG streams are left as they were.
    """

    def __init__(self, source: Dataset, transform: Callable[[Any], Any], seed: int) -> None:
        self.source, self.transform, self.seed = source, transform, seed

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, Any]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        real = index >= 0
        index = index if real else ~index
        image, target = self.source[index]
        with torch.random.fork_rng(devices=[]):
            # The CPU generator alone: torch.manual_seed would also queue a seed for every
            # CUDA device, at a cost of milliseconds per sample.
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            image, target = self.apply(image, target)
        return image, target if real else self.ignored(target)

    def apply(self, image: torch.Tensor, target: Any) -> tuple[torch.Tensor, Any]:
        """The seeded transform of one sample: the image alone, or with a dict target the two
        together (``tv_tensors.BoundingBoxes`` in it are resized and cropped with the image;
        other entries pass through)."""
        if isinstance(target, Mapping):
            return self.transform(image, target)
        return self.transform(image), target

    def ignored(self, target: Any) -> Any:
        """A padding duplicate's target: nothing of it is counted."""
        return IGNORE_LABEL
