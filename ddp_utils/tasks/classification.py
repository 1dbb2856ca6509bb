"""Image classification: cross-entropy with label smoothing, on hard labels or on the soft
targets of MixUp / CutMix (``torchvision.transforms.v2``) applied to the device batch; its
metrics from torchmetrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from ddp_utils.config import DataConfig, TrainConfig
from ddp_utils.data.samplers import IGNORE_LABEL
from ddp_utils.tasks.base import Batch, Task

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


def label_arguments(cfg: TrainConfig) -> dict[str, Any]:
    """What the label options give a task that has them (``TaskConfig.label_options``)."""
    return {"label_smoothing": cfg.trainer.label_smoothing, "mixing": build_mixing(cfg.data)}


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


TOP_K = 5  # top-5 accuracy, a default when there are more than 5 classes
_TM = "torchmetrics.classification."


def classification_metrics(num_classes: int) -> dict[str, dict[str, Any]]:
    """The default metrics (the names eval.json has always used)."""
    n = num_classes
    # validate_args=False: torchmetrics' checks run torch.unique on every update, a host sync
    # per batch on a GPU; the labels were checked by the loss (cross_entropy refuses one out
    # of range) before they reach a metric.
    metrics: dict[str, dict[str, Any]] = {
        "accuracy": {
            "_target_": _TM + "MulticlassAccuracy",
            "num_classes": n,
            "average": "micro",
            "validate_args": False,
        },
        "f1_macro": {
            "_target_": _TM + "MulticlassF1Score",
            "num_classes": n,
            "average": "macro",
            "validate_args": False,
        },
        # A class's accuracy is its recall (0 for a class without samples).
        "per_class_accuracy": {
            "_target_": _TM + "MulticlassRecall",
            "num_classes": n,
            "average": "none",
            "validate_args": False,
        },  # fmt: skip
        "confusion_matrix": {
            "_target_": _TM + "MulticlassConfusionMatrix",
            "num_classes": n,
            "validate_args": False,
        },
    }
    if n > TOP_K:
        metrics[f"top{TOP_K}"] = {"_target_": _TM + "MulticlassAccuracy", "num_classes": n,
                                  "average": "micro", "top_k": TOP_K,
                                  "validate_args": False}  # fmt: skip
    return metrics


class Classification(Task):
    """``task=classification``: logits (N, num_classes) against integer labels."""

    def __init__(self, num_classes: int, label_smoothing: float = 0.0,
                 mixing: v2.Transform | None = None) -> None:  # fmt: skip
        self.num_classes = num_classes
        self.criterion = Criterion(num_classes, label_smoothing, mixing)

    def train_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        n_real = batch.count()  # before mixing, which makes the labels soft
        inputs, targets = self.criterion.mix(batch.inputs, batch.target)
        return self.criterion.loss_sum(model(inputs), targets), n_real

    def eval_step(
        self, model: nn.Module, batch: Batch, metrics: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(batch.inputs).float()
        loss = F.cross_entropy(logits, batch.target, ignore_index=IGNORE_LABEL, reduction="sum")
        metrics.update(batch.select(logits), batch.select(batch.target))
        return loss, batch.count()

    def metrics(self) -> dict[str, Any]:
        return classification_metrics(self.num_classes)

    def output_shape(self, n: int) -> tuple[int, ...]:
        return (n, self.num_classes)

    def output_keys(self) -> str:
        return f"data.num_classes={self.num_classes}"
