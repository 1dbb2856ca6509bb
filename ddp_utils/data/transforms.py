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
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

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


class CropFlip(v2.Transform):
    """``RandomResizedCrop(size)`` then ``RandomHorizontalFlip()`` as v2 runs them (the same
    random draws in the same order, the same kernels: identical pixels), in one step. A plain
    image tensor skips v2's per-transform machinery, which was 60% of a sample's time in a
    worker on small images (``make bench-shards``); any other input goes through v2."""

    def __init__(self, size: int, interpolation: v2.InterpolationMode) -> None:
        super().__init__()
        self.crop = v2.RandomResizedCrop(size, interpolation=interpolation, antialias=True)
        self.flip = v2.RandomHorizontalFlip()

    def forward(self, *inputs: Any) -> Any:
        if len(inputs) == 1 and type(inputs[0]) is torch.Tensor:
            return self.fast(inputs[0])
        return self.flip(self.crop(*inputs))

    def fast(self, image: torch.Tensor) -> torch.Tensor:
        top, left, h, w = self.crop_box(image.shape[-2], image.shape[-1])
        c = self.crop
        out = F.resized_crop_image(image, top, left, h, w, c.size, c.interpolation, True)
        return F.horizontal_flip_image(out) if torch.rand(1) < self.flip.p else out

    def crop_box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """``RandomResizedCrop.make_params``' draws and arithmetic, line for line."""
        area, (scale, ratio, log_ratio) = height * width, (self.crop.scale, self.crop.ratio,
                                                           self.crop._log_ratio)  # fmt: skip
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
            aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)).item())
                left = int(torch.randint(0, width - w + 1, size=(1,)).item())
                return top, left, h, w
        in_ratio = float(width) / float(height)
        if in_ratio < min(ratio):
            w, h = width, int(round(width / min(ratio)))
        elif in_ratio > max(ratio):
            h, w = height, int(round(height * max(ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


def train_transform(cfg: DataConfig) -> v2.Transform:
    """The references' training preset: ``RandomResizedCrop(train_crop_size)`` + flip
    (without ``data.augment``, the evaluation preset), then ``data.auto_augment`` and
    ``data.random_erase``, all on uint8 tensors."""
    mode = INTERPOLATIONS[cfg.interpolation]
    if cfg.augment:
        steps = [CropFlip(cfg.train_crop_size or cfg.image_size, mode)]
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
