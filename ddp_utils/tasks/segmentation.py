"""Semantic segmentation: per-pixel cross-entropy on the model's ``out`` (and its auxiliary
head's, weighted by ``task.aux_weight``), metrics from torchmetrics' confusion matrices.

Targets are int64 masks (N, H, W) with ``IGNORE_LABEL`` where a pixel is not counted (the
data's ``ignore_index``, crop padding, a padding duplicate): the loss is summed over the
counted pixels and divided by their number, so it is exact at any world size and under
gradient accumulation. The mean IoU follows torchmetrics: a class absent from both the truth
and the predictions of the whole set is left out of the mean (its per-class IoU reads 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ddp_utils.data.samplers import IGNORE_LABEL
from ddp_utils.models.probe import eval_mode
from ddp_utils.tasks.base import Batch, Task

_TM = "torchmetrics.classification."
PICTURED = 4  # validation images in predictions.png


def segmentation_metrics(num_classes: int) -> dict[str, dict[str, Any]]:
    """The default metrics; ``validate_args=False``: the masks are checked when read, and the
    checks cost a pass over every pixel per metric per batch."""
    common = {"num_classes": num_classes, "ignore_index": IGNORE_LABEL, "validate_args": False}
    return {
        "miou": {"_target_": _TM + "MulticlassJaccardIndex", "average": "macro", **common},
        "pixel_accuracy": {"_target_": _TM + "MulticlassAccuracy", "average": "micro", **common},
        "per_class_iou": {"_target_": _TM + "MulticlassJaccardIndex", "average": "none", **common},
        "confusion_matrix": {"_target_": _TM + "MulticlassConfusionMatrix", **common},
    }


def split_output(out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, aux)`` of a tensor or of torchvision's ``{"out": ..., "aux": ...}``."""
    if isinstance(out, dict):
        return out["out"], out.get("aux")
    return out, None


def pixel_loss_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the counted pixels (``IGNORE_LABEL`` ones are not)."""
    return F.cross_entropy(logits.float(), target, ignore_index=IGNORE_LABEL, reduction="sum")


class Segmentation(Task):
    """``task=segmentation``: logits (N, num_classes, H, W) against masks (N, H, W)."""

    # The models bring their logits to the mask's size with bilinear upsampling, whose CUDA
    # backward (atomic adds) has no deterministic kernel.
    nondeterministic_on_cuda = "bilinear upsampling's backward (upsample_bilinear2d)"

    def __init__(self, num_classes: int, image_size: int, aux_weight: float = 0.5) -> None:
        self.num_classes, self.image_size, self.aux_weight = num_classes, image_size, aux_weight

    def train_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits, aux = split_output(model(batch.inputs))
        loss = pixel_loss_sum(logits, batch.target)
        if aux is not None and self.aux_weight > 0:
            loss = loss + self.aux_weight * pixel_loss_sum(aux, batch.target)
        return loss, batch.count()

    def eval_step(
        self, model: nn.Module, batch: Batch, metrics: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _ = split_output(model(batch.inputs))
        metrics.update(logits.argmax(1), batch.target)
        # The evaluation loss is the main head's, as the references report it.
        return pixel_loss_sum(logits, batch.target), batch.count()

    def metrics(self) -> dict[str, Any]:
        return segmentation_metrics(self.num_classes)

    def output_shape(self, n: int) -> tuple[int, ...]:
        return (n, self.num_classes, self.image_size, self.image_size)

    def logits(self, out: Any) -> Any:
        return out.get("out", out) if isinstance(out, dict) else out

    def blank_target(self, n: int, size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(n, size, size, dtype=torch.long, device=device)

    def output_keys(self) -> str:
        return (f"data.num_classes={self.num_classes} (scores per pixel at the input's size, "
                "as torchvision's segmentation models give in `out`)")  # fmt: skip

    def draw(self, model: nn.Module, dataset: Any, preprocess: nn.Module, device: torch.device,
             classes: list[str] | None, out_dir: Path) -> Path | None:  # fmt: skip
        """``predictions.png``: the first validation images, their truth and the prediction."""
        from ddp_utils.plot import plot_predictions

        samples = [dataset[i] for i in range(min(PICTURED, len(dataset)))]
        if not samples:
            return None
        images = torch.stack([image for image, _ in samples])
        truths = torch.stack([mask for _, mask in samples])
        with eval_mode(model):
            logits, _ = split_output(model(preprocess(images.to(device))))
        preds = logits.argmax(1).cpu()
        names = classes or [str(c) for c in range(self.num_classes)]
        return plot_predictions(images, truths, preds, names, out_dir / "predictions.png")
