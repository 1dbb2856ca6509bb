"""Object detection: a torchvision-style detector (``model(images, targets)`` returns its
losses in training, per-image ``{"boxes", "scores", "labels"}`` in evaluation) trained on its
own losses, scored by COCO's mAP through torchmetrics' ``MeanAveragePrecision``.

The evaluation joins the metric's per-image lists in the data set's order on every rank
(``ddp_utils.evaluation.BatchOrder``), so mAP, COCO's tie-breaks included, is the same at any
world size, to the last digit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchmetrics.detection import MeanAveragePrecision

from ddp_utils.models.probe import eval_mode
from ddp_utils.tasks.base import Batch, Task, sentinel_of

BACKEND = "faster_coco_eval"  # COCO's evaluation behind torchmetrics' MeanAveragePrecision


@contextlib.contextmanager
def quiet(logger: str, when: bool = True) -> Iterator[None]:
    """``logger``'s INFO lines held back for the block (``when``)."""
    log = logging.getLogger(logger)
    level = log.level
    if when:
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


class ExactMeanAveragePrecision(MeanAveragePrecision):
    """``MeanAveragePrecision`` on faster-coco-eval; its per-image lists are joined in the
    data set's order by the evaluation (``BatchOrder``), so COCO's tie-breaks are world size
    1's. COCO's summary tables (a dozen lines an evaluation) stay out of the log unless
    ``print_summary`` (``task.coco_summary=true``)."""

    def __init__(self, print_summary: bool = False, **kwargs: Any) -> None:
        # faster-coco-eval (the [det] extra) unless asked otherwise: torchmetrics' default,
        # pycocotools, is slower and not one of our dependencies.
        kwargs.setdefault("backend", BACKEND)
        super().__init__(**kwargs)
        self.print_summary = print_summary

    def compute(self) -> dict[str, torch.Tensor]:
        with quiet("faster_coco_eval", when=not self.print_summary):
            return super().compute()


def real_parts(
    batch: Batch, training: bool
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The real images and their targets (``boxes`` as plain tensors), padding left out.
    Crowd boxes (``iscrowd``) are left out of training and kept, marked, for the mAP."""
    images, targets = [], []
    for image, target in zip(batch.inputs, batch.target, strict=True):
        if sentinel_of(target) is not None:  # read on the host: no device round trip a step
            continue
        boxes, labels = target["boxes"].as_subclass(torch.Tensor), target["labels"]
        crowd = target.get("iscrowd", torch.zeros_like(labels))
        if training:
            keep = crowd == 0
            targets.append({"boxes": boxes[keep], "labels": labels[keep]})
        else:
            targets.append({"boxes": boxes, "labels": labels, "iscrowd": crowd})
        images.append(image)
    return images, targets


PICTURED = 4  # validation images in predictions.png


class Detection(Task):
    """The detector's summed losses, weighted by the batch's real images; mAP, mAP@50,
    mAP@75 and per-class AP (``map_per_class``)."""

    loss_in_eval_mode = False  # a torchvision detector gives losses in training mode only
    fixed_input_shapes = False  # each image keeps its size (torchvision's detection reference)

    def __init__(self, num_classes: int, coco_summary: bool = False) -> None:
        self.num_classes, self.coco_summary = num_classes, coco_summary

    def to_batch(self, images: Any, target: Any, device: torch.device, preprocess: nn.Module,
                 skip_bad: bool = False, all_real: bool = False) -> Batch:  # fmt: skip
        """Images of different sizes come as a list: each is preprocessed on its own."""
        if isinstance(images, torch.Tensor):
            return super().to_batch(images, target, device, preprocess, skip_bad, all_real)
        inputs = [preprocess(im.unsqueeze(0).to(device, non_blocking=True))[0] for im in images]
        batch = super().to_batch(torch.empty(0), target, device, nn.Identity(), skip_bad, all_real)
        batch.inputs = inputs
        return batch

    def metrics(self) -> dict[str, Any]:
        # faster-coco-eval: the same numbers as pycocotools, computed in C++ (docs/detection.md
        # compares them).
        return {"map": ExactMeanAveragePrecision(box_format="xyxy", iou_type="bbox",
                                                 class_metrics=True,
                                                 print_summary=self.coco_summary)}  # fmt: skip

    def eval_forwards(self, n: int) -> int:
        return n  # one an image (eval_step)

    def idle_forward(self, model: nn.Module, batch: Batch) -> None:
        model([batch.inputs[0]])

    def blank_target(self, n: int, size: int, device: torch.device) -> list[dict[str, Any]]:
        empty = {"boxes": torch.zeros(0, 4, device=device),
                 "labels": torch.zeros(0, dtype=torch.int64, device=device)}  # fmt: skip
        return [dict(empty) for _ in range(n)]

    def train_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        images, targets = real_parts(batch, training=True)
        if not images:  # padding only: a zero loss through every weight (DDP waits for all)
            losses = model([batch.inputs[0]], self.blank_target(1, 0, batch.inputs[0].device))
            return sum(losses.values()) * 0.0, batch.count()
        losses = model(images, targets)
        count = batch.count()
        return sum(losses.values()) * count, count

    def eval_step(
        self, model: nn.Module, batch: Batch, metrics: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, targets = real_parts(batch, training=False)
        # One image at a time, as torchvision's detection reference evaluates (some detectors'
        # CPU kernels give an image other scores alone than in a batch), every image of the
        # batch: a skipped one too, so that a sharded model's ranks run as many forwards.
        predictions = [model([image])[0] for image in batch.inputs]
        real = [p for p, t in zip(predictions, batch.target, strict=True) if sentinel_of(t) is None]
        if real:
            metrics["map"].update([{k: v.float() if k != "labels" else v for k, v in p.items()}
                                   for p in real], targets)  # fmt: skip
        # Detectors score no loss in eval mode: the loss column holds 0, the count the images.
        return torch.zeros((), device=batch.real.device), batch.count()

    def draw(self, model: nn.Module, dataset: Any, preprocess: nn.Module, device: torch.device,
             classes: list[str] | None, out_dir: Path) -> Path | None:  # fmt: skip
        """``predictions.png``: the first validation images, their true and predicted boxes."""
        from ddp_utils.plot import plot_boxes

        samples = [dataset[i] for i in range(min(PICTURED, len(dataset)))]
        if not samples:
            return None
        images = [image for image, _ in samples]
        with eval_mode(model):
            preds = model([preprocess(im.unsqueeze(0).to(device))[0] for im in images])
        preds = [{k: v.cpu() for k, v in p.items()} for p in preds]
        names = classes or [str(c) for c in range(self.num_classes)]
        return plot_boxes(
            images, [t for _, t in samples], preds, names, out_dir / "predictions.png"
        )
