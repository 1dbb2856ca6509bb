"""What the detection folders share: one image file's boxes checked against its size, errors
that name the file, the annotation and the fix, and the samples
``(uint8 CHW image, {"boxes": BoundingBoxes (xyxy, pixels), "labels", "iscrowd"})``.

A box marked ``iscrowd`` (COCO's crowd, VOC's ``difficult``) is left out of training and kept,
marked, for the mAP, which neither rewards nor punishes detections of it (COCO's rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchvision import tv_tensors

from ddp_utils.config import ConfigError
from ddp_utils.data.images.imagefolder import decode

EDGE_SLACK = 1.0  # pixels a box may pass its image's border by (annotation tools round)


def fail(path: Path, what: str, fix: str) -> ConfigError:
    return ConfigError(f"{path}: {what}. {fix}")


def check_xyxy(
    xyxy: list[float], width: float, height: float, path: Path, where: str, shown: object
) -> list[float]:
    """The box clipped to its image, or ConfigError naming ``where`` (the annotation) with
    the box as its file writes it (``shown``)."""
    x0, y0, x1, y1 = xyxy
    if x1 <= x0 or y1 <= y0:
        raise fail(path, f"{where} has a box of zero area ({shown})", "Remove the annotation "
                   "or give it a width and height above 0.")  # fmt: skip
    if x0 < -EDGE_SLACK or y0 < -EDGE_SLACK or x1 > width + EDGE_SLACK or y1 > height + EDGE_SLACK:
        raise fail(path, f"{where} has box {shown} outside its {width:g}x{height:g} image",
                   "Clip the box to the image, or fix the image's width and height.")  # fmt: skip
    return [max(x0, 0.0), max(y0, 0.0), min(x1, width), min(y1, height)]


@dataclass
class Annotated:
    """One image file and its boxes: ``(xyxy, label 1..K, crowd 0 | 1)`` each."""

    file: Path
    boxes: list[tuple[list[float], int, int]] = field(default_factory=list)


class BoxFiles:
    """A split of image files with their boxes, read and decoded one sample at a time."""

    def __init__(self, items: list[Annotated], classes: list[str], channels: int) -> None:
        self.items, self.classes, self.channels = items, classes, channels

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        item = self.items[i]
        # The image folders' conversion: 16-bit, palette and alpha images become uint8 grey/RGB.
        pixels = decode(str(item.file), self.channels)
        boxes = torch.tensor([b[0] for b in item.boxes], dtype=torch.float32).reshape(-1, 4)
        size = (int(pixels.shape[-2]), int(pixels.shape[-1]))
        return pixels, {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=size),
            "labels": torch.tensor([b[1] for b in item.boxes], dtype=torch.int64),
            "iscrowd": torch.tensor([b[2] for b in item.boxes], dtype=torch.int64),
        }
