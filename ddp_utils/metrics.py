"""Exact distributed evaluation: integer counts, summed over the ranks once.

Each rank scores its own shard (``EvalShardSampler``: every sample on exactly one rank) into a
confusion matrix, a top-5 hit count and a loss sum on its device. The single synchronisation is
one all_reduce of those counts in ``EvalCounts.compute``, which every rank reaches; every number
reported is derived from the summed counts, so none depends on the world size.

Why not torchmetrics (which this module used until the suite's time was measured): importing it
costs every process 2-3 s (it imports scipy.signal and matplotlib on every rank), a quarter of a
worker's start-up, and its sync gathers each state separately. Every metric here is a function of
the confusion matrix, checked against scikit-learn's in tests/test_units.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from ddp_utils.data.samplers import BAD_LABEL
from ddp_utils.dist import Runtime, all_reduce_sum
from ddp_utils.watchdog import StepWatchdog

TOP_K = 5  # top-5 accuracy, reported when there are more than 5 classes


class EvalCounts:
    """One rank's counts: the confusion matrix (rows: true class, columns: predicted class),
    top-k hits, the cross-entropy sum, and the skipped unreadable images (``BAD_LABEL``)."""

    def __init__(self, num_classes: int, device: torch.device) -> None:
        self.num_classes = num_classes
        self.top_k = TOP_K if num_classes > TOP_K else None
        # One extra bin takes the skipped images: no boolean indexing, so no host sync a batch.
        self.bins = torch.zeros(num_classes * num_classes + 1, dtype=torch.long, device=device)
        self.top_k_hits = torch.zeros((), dtype=torch.long, device=device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Add one batch: float32 ``logits`` (N, C) and labels (N,)."""
        c = self.num_classes
        counted = target != BAD_LABEL
        cell = torch.where(counted, target * c + logits.argmax(dim=1), c * c)
        self.bins += torch.bincount(cell, minlength=c * c + 1)
        if self.top_k:
            hits = (logits.topk(self.top_k, dim=1).indices == target[:, None]).any(dim=1)
            self.top_k_hits += (hits & counted).sum()
        loss = F.cross_entropy(logits, target, ignore_index=BAD_LABEL, reduction="sum")
        self.loss_sum += loss.double()

    def compute(self) -> dict[str, float | int | list]:
        """Sum the counts over the ranks (a collective: every rank calls it) and derive the
        metrics; the same result on every rank."""
        # float64 holds integer counts exactly up to 2**53: one all_reduce for everything.
        flat = torch.cat([self.bins.double(), self.top_k_hits.double()[None], self.loss_sum[None]])
        flat = all_reduce_sum(flat).cpu()
        c = self.num_classes
        counts = flat[: c * c + 1].round().long()
        return summarize(counts[:-1].view(c, c), int(counts[-1]), flat[-2].item(), flat[-1].item(),
                         self.top_k)  # fmt: skip


def summarize(
    confusion: torch.Tensor, skipped: int, top_k_hits: float, loss_sum: float, top_k: int | None
) -> dict[str, float | int | list]:
    """The reported metrics from the summed counts. Per-class accuracy is the class's recall (0
    for a class without samples); macro F1 averages over the classes that occur as a label or a
    prediction."""
    cm = confusion.double()
    n = int(confusion.sum())
    tp = cm.diag()
    support, predicted = cm.sum(dim=1), cm.sum(dim=0)
    per_class = torch.where(support > 0, tp / support.clamp(min=1), 0.0)
    occurs = (support + predicted) > 0
    f1 = 2 * tp / (support + predicted).clamp(min=1)
    result: dict[str, float | int | list] = {
        "accuracy": tp.sum().item() / max(n, 1),
        "f1_macro": f1[occurs].mean().item() if occurs.any() else 0.0,
        "per_class_accuracy": per_class.tolist(),
        "confusion_matrix": confusion.tolist(),
        "loss": loss_sum / max(n, 1),
        "num_samples": n,
        "skipped_images": skipped,
    }
    if top_k:
        result[f"top{top_k}"] = top_k_hits / max(n, 1)
    return result


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
    watchdog: StepWatchdog | None = None,
) -> dict[str, float | int | list]:
    """Score ``model`` (the unwrapped module) on the sharded ``loader``; same result on all ranks.

    The unwrapped model is used on purpose: a DDP forward may broadcast buffers, a collective
    that would deadlock when ranks hold different numbers of batches. ``watchdog`` times each
    batch (not the final collective, where a rank waits for a slower one).
    """
    was_training = model.training
    model.eval()
    counts = EvalCounts(num_classes, rt.device)
    beat = watchdog.beat if watchdog is not None else lambda phase: None
    beat("val")
    for images, labels in loader:
        images = preprocess(images.to(rt.device, non_blocking=True))
        labels = labels.to(rt.device, non_blocking=True)
        with amp():
            logits = model(images)
        counts.update(logits.float(), labels)
        beat("val")
    if watchdog is not None:
        watchdog.disarm()
    result = counts.compute()
    model.train(was_training)
    expected = len(loader.dataset)
    if result["num_samples"] + result["skipped_images"] != expected:
        raise CountMismatchError(
            f"evaluation counted {result['num_samples']} predictions and "
            f"{result['skipped_images']} skipped images for a set of {expected}"
        )
    return result
