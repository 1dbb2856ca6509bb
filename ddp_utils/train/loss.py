"""The training loss: cross-entropy with label smoothing, on hard labels or on the soft
targets of MixUp / CutMix (``torchvision.transforms.v2``) applied to the device batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from ddp_utils.config import DataConfig
from ddp_utils.data import IGNORE_LABEL

if TYPE_CHECKING:
    from torchvision.transforms import v2


def build_mixing(cfg: DataConfig) -> v2.Transform | None:
    """The references' choice: MixUp, CutMix, or one of the two at random for each batch.

    One class more than the data has: padding duplicates are mixed as that class, whose share
    of a target is then dropped (see ``Criterion.mix``).
    """
    if cfg.mixup_alpha <= 0 and cfg.cutmix_alpha <= 0:
        return None
    from torchvision.transforms import v2  # only when mixing: runs without it start faster

    k = cfg.num_classes + 1
    mixes: list[v2.Transform] = []
    if cfg.mixup_alpha > 0:
        mixes.append(v2.MixUp(alpha=cfg.mixup_alpha, num_classes=k))
    if cfg.cutmix_alpha > 0:
        mixes.append(v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=k))
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)


class Criterion:
    """``mix(images, labels)``, then ``loss_sum(logits, targets)`` over the real samples.

    Labels of padding duplicates are ``IGNORE_LABEL``: with hard labels cross-entropy ignores
    them; with mixing their rows get an all-zero target (no loss), and a real sample mixed with
    one keeps only its own share of the target.
    """

    def __init__(self, num_classes: int, label_smoothing: float, mixing: v2.Transform | None):
        self.num_classes, self.label_smoothing, self.mixing = num_classes, label_smoothing, mixing

    def mix(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mixing is None:
            return images, labels
        pad = labels == IGNORE_LABEL
        mixed, soft = self.mixing(images, torch.where(pad, self.num_classes, labels))
        return mixed, soft[:, : self.num_classes] * (~pad)[:, None]

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed over the batch's real samples (the caller divides by their number)."""
        logits = logits.float()
        ls = self.label_smoothing
        if targets.ndim == 1:
            return F.cross_entropy(
                logits, targets, ignore_index=IGNORE_LABEL, reduction="sum", label_smoothing=ls
            )
        rows = F.cross_entropy(logits, targets, reduction="none", label_smoothing=ls)
        return (rows * (targets.sum(1) > 0)).sum()
