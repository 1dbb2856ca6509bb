"""Per-sample transforms in the loader's workers, batched preprocessing on the device.

Streamed sources (image folders, custom sets) are transformed per sample with
``torchvision.transforms.v2`` on uint8 tensors, the classification references' presets:
training ``RandomResizedCrop`` + horizontal flip, evaluation ``Resize`` + ``CenterCrop``. The
random draws of a sample are a function of (seed, epoch, index) alone: each sample runs its
transform under its own RNG seed, so neither the number of workers, nor the world size, nor
a mid-epoch resume changes what a sample looks like. Normalisation stays on the device
(``ddp_utils.data.images.preprocess``).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

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
    """``RandomResizedCrop(size)`` then ``RandomHorizontalFlip()`` in one step.

    Called as a v2 transform it makes v2's pixels from v2's draws (the same random numbers in
    the same order, the same kernels). ``seeded(image, seed)`` is the per-sample path
    ``SeededTransform`` takes: the same crop arithmetic and kernel, with the draws taken from
    ``random.Random(seed)``, so it needs neither torch's global generator nor ``fork_rng``.
    v2's per-transform machinery and torch's one-number draws were most of a sample's time
    in a worker on small images (``make bench-shards``)."""

    def __init__(self, size: int, interpolation: v2.InterpolationMode) -> None:
        super().__init__()
        self.crop = v2.RandomResizedCrop(size, interpolation=interpolation, antialias=True)
        self.flip = v2.RandomHorizontalFlip()
        # Plain floats: v2 keeps the log-ratio as tensors, and arithmetic on them cost more
        # than the rest of a draw. uniform_ takes these very values.
        self.scale = tuple(float(v) for v in self.crop.scale)
        self.log_ratio = tuple(float(v) for v in self.crop._log_ratio)
        self.native = native_uint8_resize(interpolation)

    def forward(self, *inputs: Any) -> Any:
        if len(inputs) == 1 and type(inputs[0]) is torch.Tensor:
            return self.apply(inputs[0], TorchDraws())
        return self.flip(self.crop(*inputs))

    def seeded(self, image: torch.Tensor, seed: int) -> torch.Tensor:
        return self.apply(image, SeedDraws(seed))

    def apply(self, image: torch.Tensor, draws: Draws) -> torch.Tensor:
        top, left, h, w = self.crop_box(image.shape[-2], image.shape[-1], draws)
        out = self.resized_crop(image, top, left, h, w)
        return F.horizontal_flip_image(out) if draws.random() < self.flip.p else out

    def resized_crop(
        self, image: torch.Tensor, top: int, left: int, h: int, w: int
    ) -> torch.Tensor:
        """v2's ``resized_crop_image`` for a crop inside the image; a uint8 CHW image on the CPU
        goes straight to the call v2 ends in, whose checks cost as much as the resize."""
        c = self.crop
        if not (self.native and image.dtype == torch.uint8 and image.ndim == 3
                and image.device.type == "cpu"):  # fmt: skip
            return F.resized_crop_image(image, top, left, h, w, c.size, c.interpolation, True)
        crop = image[:, top : top + h, left : left + w]
        if [h, w] == c.size:
            return crop
        return torch.nn.functional.interpolate(
            crop[None], size=c.size, mode=c.interpolation.value, align_corners=False,
            antialias=True,
        )[0]  # fmt: skip

    def crop_box(self, height: int, width: int, draws: Draws) -> tuple[int, int, int, int]:
        """``RandomResizedCrop.make_params``' draws and arithmetic, line for line."""
        area, scale, ratio, log_ratio = height * width, self.scale, self.crop.ratio, self.log_ratio
        for _ in range(10):
            target_area = area * draws.uniform(scale[0], scale[1])
            aspect = draws.exp_uniform(log_ratio[0], log_ratio[1])
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return draws.randint(0, height - h), draws.randint(0, width - w), h, w
        in_ratio = float(width) / float(height)
        if in_ratio < min(ratio):
            w, h = width, int(round(width / min(ratio)))
        elif in_ratio > max(ratio):
            h, w = height, int(round(height * max(ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


def native_uint8_resize(interpolation: v2.InterpolationMode) -> bool:
    """Whether v2 resizes a uint8 image on the CPU with interpolate's uint8 kernel (as it
    decides; no shortcut where torchvision does not say)."""
    try:
        from torchvision.transforms.v2.functional._geometry import _do_native_uint8_resize_on_cpu
    except ImportError:
        return False
    return _do_native_uint8_resize_on_cpu(interpolation)


class Draws(Protocol):
    """Where ``CropFlip`` takes its random numbers from."""

    def uniform(self, a: float, b: float) -> float: ...
    def exp_uniform(self, a: float, b: float) -> float: ...
    def randint(self, a: int, b: int) -> int: ...  # a <= n <= b
    def random(self) -> float: ...


class TorchDraws:
    """torch's global generator, drawn as v2's transforms draw from it."""

    def uniform(self, a: float, b: float) -> float:
        return torch.empty(1).uniform_(a, b).item()

    def exp_uniform(self, a: float, b: float) -> float:
        return torch.exp(torch.empty(1).uniform_(a, b)).item()

    def randint(self, a: int, b: int) -> int:
        return int(torch.randint(a, b + 1, size=(1,)).item())

    def random(self) -> float:
        return torch.rand(1).item()


class SeedDraws(random.Random):
    """A sample's own stream: Python's generator, seeded with the sample's seed."""

    def exp_uniform(self, a: float, b: float) -> float:
        return math.exp(self.uniform(a, b))


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
    return steps[0] if len(steps) == 1 else v2.Compose(steps)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed that depends on (seed, epoch, index) and nothing else."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeededTransform(Dataset):
    """A source of ``(uint8 CHW tensor, label)`` with a per-sample transform applied.

    A key is an index, or ``(epoch, index)`` from ``EpochTagged``; a negative index is a
    sampler's padding duplicate (its label is ignored). The transform runs under
    ``fork_rng`` with the sample's own seed, so the caller's RNG streams are left as they were;
    a transform with a ``seeded(image, seed)`` method (``CropFlip``) is given the seed instead.
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
        seed = sample_seed(self.seed, epoch, index)
        seeded = getattr(self.transform, "seeded", None)
        if seeded is not None and not isinstance(target, Mapping):
            image = seeded(image, seed)  # it draws from the seed alone: no generator to guard
        else:
            with torch.random.fork_rng(devices=[]):
                # The CPU generator alone: torch.manual_seed would also queue a seed for every
                # CUDA device, at a cost of milliseconds per sample.
                torch.default_generator.manual_seed(seed)
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
