"""Joint image + mask transforms (``torchvision.transforms.v2`` with ``tv_tensors.Mask``),
seeded per sample like the classification path.

Training (``data.augment``): the shorter side resized to a random size in
``data.scale_range`` x ``data.base_size``, a random ``data.crop_size`` crop (an image smaller
than the crop is padded at the bottom and right, its mask with ``data.ignore_index``), a
horizontal flip (``data.hflip``); done as one ``resized_crop`` of the window the crop covers.
Evaluation: the shorter side resized to ``data.eval_size`` (null: the image's
own size), then padded at the bottom and right to the split's largest size, the mask with the
ignored value. Padding every image to one size, not to its batch's largest, keeps an image's
prediction independent of the images it shares a batch with, so the metrics do not change
with the world size. Masks are resized with nearest neighbour only (v2 does so for a Mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from ddp_utils.config import SegmentationData
from ddp_utils.data.images.transforms import INTERPOLATIONS, SeededTransform
from ddp_utils.data.samplers import IGNORE_LABEL

Pair = tuple[torch.Tensor, torch.Tensor]


def short_side_shape(h: int, w: int, size: int | None) -> tuple[int, int]:
    """(h, w) with the shorter side resized to ``size`` (the longer in proportion, rounded
    down as torchvision's Resize does), or unchanged for None. Computed here because the
    evaluation canvas must be known from the headers, before any image is read."""
    if size is None:
        return h, w
    if h <= w:
        return size, int(size * w / h)
    return int(size * h / w), size


def pad_bottom_right(image: torch.Tensor, mask: torch.Tensor, size: tuple[int, int],
                     ignore: int) -> Pair:  # fmt: skip
    """Pad to ``size`` (h, w) at the bottom and right: the image with 0, the mask with the
    ignored value."""
    pad = (0, size[1] - image.shape[-1], 0, size[0] - image.shape[-2])
    if any(pad):
        image = F.pad(image.as_subclass(torch.Tensor), pad, value=0)
        mask = F.pad(mask.as_subclass(torch.Tensor), pad, value=ignore)
    return image, mask


class EvalResizePad:
    """Resize to ``short_side_shape``, then pad to ``canvas`` (h, w) at the bottom and right."""

    def __init__(self, cfg: SegmentationData, canvas: tuple[int, int]) -> None:
        self.eval_size, self.canvas, self.ignore = cfg.eval_size, canvas, cfg.ignore_index
        self.mode = INTERPOLATIONS[cfg.interpolation]

    def __call__(self, image: torch.Tensor, mask: torch.Tensor) -> Pair:
        h, w = short_side_shape(image.shape[-2], image.shape[-1], self.eval_size)
        if (h, w) != tuple(image.shape[-2:]):
            image = TF.resize(image, [h, w], interpolation=self.mode, antialias=True)
            mask = TF.resize(tv_tensors.Mask(mask), [h, w])  # a Mask: nearest neighbour
        return pad_bottom_right(image, mask, self.canvas, self.ignore)


class ScaleCropFlip:
    """The references' random resize, crop (padding what is short of it) and flip, computed
    as one ``resized_crop`` of the source region the crop covers: the same picture as
    resizing the whole image and then cropping, without resizing the pixels the crop throws
    away (a 2x upscale of a 500x375 image is 750,000 pixels, its 480x480 crop 230,400)."""

    def __init__(self, cfg: SegmentationData) -> None:
        self.lo, self.hi = (round(f * cfg.base_size) for f in cfg.scale_range)
        self.crop, self.ignore, self.hflip = cfg.crop_size, cfg.ignore_index, cfg.hflip
        self.mode = INTERPOLATIONS[cfg.interpolation]

    def __call__(self, image: torch.Tensor, mask: torch.Tensor) -> Pair:
        h, w = image.shape[-2:]
        nh, nw = short_side_shape(h, w, int(torch.randint(self.lo, self.hi + 1, ())))
        ch, cw = min(self.crop, nh), min(self.crop, nw)
        top = int(torch.randint(0, nh - ch + 1, ()))
        left = int(torch.randint(0, nw - cw + 1, ()))
        # The crop's window in source pixels (at least one).
        y0, x0 = round(top * h / nh), round(left * w / nw)
        sh, sw = max(1, round(ch * h / nh)), max(1, round(cw * w / nw))
        image = TF.resized_crop(tv_tensors.Image(image), y0, x0, sh, sw, [ch, cw],
                                interpolation=self.mode, antialias=True)  # fmt: skip
        mask = TF.resized_crop(tv_tensors.Mask(mask), y0, x0, sh, sw, [ch, cw])  # nearest
        image, mask = pad_bottom_right(image, mask, (self.crop, self.crop), self.ignore)
        if self.hflip and bool(torch.rand(()) < 0.5):
            image, mask = image.flip(-1), mask.flip(-1)
        return image, mask


def train_transform(cfg: SegmentationData) -> Callable[[torch.Tensor, torch.Tensor], Pair]:
    """The references' training preset, on uint8 tensors."""
    return ScaleCropFlip(cfg)


class SeededPairs(SeededTransform):
    """``(uint8 CHW image, int64 HW mask)``: the source's pair through a joint transform under
    the sample's seed; the mask's ``ignore_index`` becomes ``IGNORE_LABEL`` (cross-entropy's
    and the metrics' ignored value), and a padding duplicate's mask is ignored everywhere."""

    def __init__(self, source: Any, transform: Callable, seed: int, ignore_index: int) -> None:
        super().__init__(source, transform, seed)
        self.ignore_index = ignore_index

    def apply(self, image: torch.Tensor, mask: torch.Tensor) -> Pair:
        image, mask = self.transform(image, mask)
        mask = mask.as_subclass(torch.Tensor).to(torch.int64)
        image = image.as_subclass(torch.Tensor)
        return image, mask.masked_fill_(mask == self.ignore_index, IGNORE_LABEL)

    def ignored(self, target: torch.Tensor) -> torch.Tensor:
        return torch.full_like(target, IGNORE_LABEL)
