"""``data=digits_det``: detection canvases made from scikit-learn's 8x8 digits.

Each canvas holds one to ``data.max_digits`` digits of its split, each upscaled by one of
``data.digit_scales`` and put at a random place where it overlaps no earlier one; its box is
the tight box around the digit's ink (grey level at least a quarter of white), its label the
digit + 1 (0 is the background). A split has as many canvases as digits and uses only its own
digits; the layout is drawn from ``data.split_seed`` and the split, the same on every rank.
"""

from __future__ import annotations

import torch
from torchvision import tv_tensors

from ddp_utils.config import DigitsDetData
from ddp_utils.data.images.builtin import decode
from ddp_utils.data.segmentation.canvases import INK, scale

PLACEMENT_TRIES = 20  # a digit that finds no free place after this many draws is left out


def ink_box(digit: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(x0, y0, x1, y1) of the ink of a (h, w) uint8 digit, exclusive ends; None if blank."""
    ys, xs = torch.nonzero(digit >= INK, as_tuple=True)
    if len(ys) == 0:
        return None
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def overlaps(box: tuple[int, int, int, int], others: list[tuple[int, int, int, int]]) -> bool:
    x0, y0, x1, y1 = box
    return any(x0 < b[2] and b[0] < x1 and y0 < b[3] and b[1] < y1 for b in others)


class DetCanvasSource:
    """The canvases of one split, in memory: ``(uint8 CHW image, {"boxes", "labels"})``."""

    def __init__(self, cfg: DigitsDetData, split: str) -> None:
        digits, labels = decode(cfg.digit_data(), split)
        size, n = cfg.canvas_size, len(labels)
        g = torch.Generator().manual_seed(cfg.split_seed * 2 + (split == "val"))
        scaled = {s: scale(digits, s) for s in cfg.digit_scales}
        self.images = torch.zeros(n, 1, size, size, dtype=torch.uint8)
        self.targets: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(n):
            placed: list[tuple[int, int, int, int]] = []
            classes: list[int] = []
            count = int(torch.randint(1, cfg.max_digits + 1, (), generator=g))
            for j in torch.randint(0, n, (count,), generator=g).tolist():
                s = cfg.digit_scales[int(torch.randint(0, len(cfg.digit_scales), (), generator=g))]
                self.place(i, scaled[s][j, 0], int(labels[j]) + 1, g, placed, classes)
            boxes = torch.tensor(placed, dtype=torch.float32).reshape(-1, 4)
            self.targets.append((boxes, torch.tensor(classes, dtype=torch.int64)))
        self.size = size
        self.classes = ["background"] + [str(d) for d in range(10)]

    def place(self, i: int, digit: torch.Tensor, label: int, g: torch.Generator,
              placed: list, classes: list) -> None:  # fmt: skip
        """Paste ``digit`` on canvas ``i`` where its ink box overlaps no box placed before."""
        ink = ink_box(digit)
        h, w = digit.shape
        if ink is None or h > self.images.shape[-1]:
            return
        for _ in range(PLACEMENT_TRIES):
            y = int(torch.randint(0, self.images.shape[-2] - h + 1, (), generator=g))
            x = int(torch.randint(0, self.images.shape[-1] - w + 1, (), generator=g))
            box = (x + ink[0], y + ink[1], x + ink[2], y + ink[3])
            if not overlaps(box, placed):
                patch = self.images[i, 0, y : y + h, x : x + w]
                patch.copy_(torch.maximum(patch, digit))  # a neighbour's ink stays
                placed.append(box)
                classes.append(label)
                return

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        boxes, labels = self.targets[i]
        box = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(self.size, self.size))
        return self.images[i], {"boxes": box, "labels": labels}
