"""``data=digits_seg`` and ``data=mnist_seg``: segmentation canvases made from digit images.

Each canvas holds one to ``data.max_digits`` digits of its split, each upscaled by one of
``data.digit_scales`` and put at a random place (a later digit covers an earlier one); the
mask is digit + 1 where the digit's grey level is at least a quarter of white, 0 elsewhere.
A split has as many canvases as digits, and its canvases use only its own digits, so the
validation canvases hold no digit the model was trained on. The layout is drawn from
``data.split_seed`` and the split: the same canvases on every rank and machine.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ddp_utils.config import CanvasData, ConfigError
from ddp_utils.data.images.builtin import decode

INK = 64  # a digit's pixel counts from this grey level (of 255)


def digit_split(cfg: CanvasData, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The split's digits, uint8 (N, 1, h, w), and their labels: data=digits' split (with
    ``data.val_fraction`` and ``data.val_slice``) or MNIST's under ``data.root``."""
    return decode(cfg.digit_data(), split)


def make_canvases(
    digits: torch.Tensor, labels: torch.Tensor, cfg: CanvasData, split: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (N, 1, S, S) and uint8 masks (N, S, S), one canvas per digit."""
    n, size = len(labels), cfg.canvas_size
    g = torch.Generator().manual_seed(cfg.split_seed * 2 + (split == "val"))
    images = torch.zeros(n, 1, size, size, dtype=torch.uint8)
    masks = torch.zeros(n, size, size, dtype=torch.uint8)
    largest = digits.shape[-1] * max(cfg.digit_scales)
    if largest > size:
        raise ConfigError(
            f"data={cfg.name}: a {digits.shape[-1]}-pixel digit scaled by data.digit_scales="
            f"{list(cfg.digit_scales)} is {largest} pixels, more than data.canvas_size={size}; "
            "raise data.canvas_size or lower the scales."
        )
    scaled = {s: scale(digits, s) for s in cfg.digit_scales}
    for i in range(n):
        count = int(torch.randint(1, cfg.max_digits + 1, (), generator=g))
        for j in torch.randint(0, n, (count,), generator=g).tolist():
            s = cfg.digit_scales[int(torch.randint(0, len(cfg.digit_scales), (), generator=g))]
            digit = scaled[s][j, 0]
            h, w = digit.shape
            y = int(torch.randint(0, size - h + 1, (), generator=g))
            x = int(torch.randint(0, size - w + 1, (), generator=g))
            images[i, 0, y : y + h, x : x + w] = torch.maximum(
                images[i, 0, y : y + h, x : x + w], digit
            )
            ink = digit >= INK
            masks[i, y : y + h, x : x + w][ink] = int(labels[j]) + 1
    return images, masks


def scale(digits: torch.Tensor, factor: int) -> torch.Tensor:
    if factor == 1:
        return digits
    up = F.interpolate(digits.float(), scale_factor=factor, mode="bilinear", align_corners=False)
    return up.round().clamp(0, 255).to(torch.uint8)


class CanvasSource:
    """The canvases of one split, in memory: ``(uint8 CHW image, uint8 HW mask)``."""

    def __init__(self, cfg: CanvasData, split: str) -> None:
        digits, labels = digit_split(cfg, split)
        self.images, self.masks = make_canvases(digits, labels, cfg, split)
        self.classes = ["background"] + [str(d) for d in range(10)]
        self.sizes = torch.tensor([[cfg.canvas_size, cfg.canvas_size]] * len(labels))

    def __len__(self) -> int:
        return len(self.masks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.masks[i]
