"""Exact distributed evaluation with torchmetrics.

Each rank scores its own shard (``EvalShardSampler``: every sample on exactly one rank) and
only updates local metric states; the single synchronisation is torchmetrics' sync inside
``compute()``, which every rank reaches. So the numbers do not depend on the world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
)

from ddp_utils.data.samplers import BAD_LABEL
from ddp_utils.dist import Runtime


class MeanLoss(Metric):
    """Mean cross-entropy over every sample counted, on every rank."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        loss = F.cross_entropy(logits.float(), target, ignore_index=BAD_LABEL, reduction="sum")
        self.loss_sum += loss.double()
        self.count += (target != BAD_LABEL).sum()

    def compute(self) -> torch.Tensor:
        return self.loss_sum / self.count.clamp(min=1)


class NumSamples(Metric):
    """How many predictions were counted (``skipped=True``: how many unreadable images were
    skipped instead), summed over ranks."""

    full_state_update = False

    def __init__(self, skipped: bool = False) -> None:
        super().__init__()
        self.skipped = skipped
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        self.count += ((target == BAD_LABEL) == self.skipped).sum()

    def compute(self) -> torch.Tensor:
        return self.count


def build_metrics(num_classes: int, device: torch.device) -> MetricCollection:
    # Skipped unreadable images (data.skip_bad_images) carry BAD_LABEL: counted apart.
    skip = {"ignore_index": BAD_LABEL}
    metrics: dict[str, Metric] = {
        "accuracy": MulticlassAccuracy(num_classes, average="micro", **skip),
        "f1_macro": MulticlassF1Score(num_classes, average="macro", **skip),
        "per_class_accuracy": MulticlassAccuracy(num_classes, average=None, **skip),
        "confusion_matrix": MulticlassConfusionMatrix(num_classes, **skip),
        "loss": MeanLoss(),
        "num_samples": NumSamples(),
        "skipped_images": NumSamples(skipped=True),
    }
    if num_classes > 5:
        metrics["top5"] = MulticlassAccuracy(num_classes, top_k=5, average="micro", **skip)
    # compute_groups=False: each metric keeps its own states, so nothing is shared by accident.
    return MetricCollection(metrics, compute_groups=False).to(device)


class CountMismatchError(RuntimeError):
    """The evaluation counted a different number of samples than the set holds."""


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    preprocess: nn.Module,
    rt: Runtime,
    num_classes: int,
    amp: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, float | list]:
    """Score ``model`` (the unwrapped module) on the sharded ``loader``; same result on all ranks.

    The unwrapped model is used on purpose: a DDP forward may broadcast buffers, a collective
    that would deadlock when ranks hold different numbers of batches.
    """
    was_training = model.training
    model.eval()
    metrics = build_metrics(num_classes, rt.device)
    for images, labels in loader:
        images = preprocess(images.to(rt.device, non_blocking=True))
        labels = labels.to(rt.device, non_blocking=True)
        with amp():
            logits = model(images)
        metrics.update(logits.float(), labels)
    result = {k: v.tolist() if v.ndim else v.item() for k, v in metrics.compute().items()}
    model.train(was_training)
    expected = len(loader.dataset)
    result["num_samples"] = int(result["num_samples"])
    result["skipped_images"] = int(result["skipped_images"])
    if result["num_samples"] + result["skipped_images"] != expected:
        raise CountMismatchError(
            f"evaluation counted {result['num_samples']} predictions and "
            f"{result['skipped_images']} skipped images for a set of {expected}"
        )
    return result
