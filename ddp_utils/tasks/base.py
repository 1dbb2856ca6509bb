"""The task protocol: what differs between training objectives, and nothing else.

The loop, resume, checkpoints, EMA, precision, compile, the non-finite stop and the callbacks
know nothing of the task; they call ``train_loss`` for every micro-batch and evaluation calls
``eval_step`` for every batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_utils.data.samplers import IGNORE_LABEL
from ddp_utils.models.probe import blank_images


@dataclass
class Batch:
    """One device batch: ``inputs`` preprocessed (normalised, augmented), ``target`` the labels,
    ``IGNORE_LABEL`` where a row is not a real sample (a padding duplicate at an epoch's end, or
    a skipped unreadable image). Sums over ``real`` rows make means exact at any world size."""

    inputs: torch.Tensor
    target: torch.Tensor
    all_real: bool = False  # known to hold no padding and no skipped image: no mask needed

    @property
    def real(self) -> torch.Tensor:
        """A bool mask of the real rows."""
        return self.target != IGNORE_LABEL

    def count(self) -> torch.Tensor:
        """The number of real rows (real pixels for a mask target), on the device."""
        return self.real.sum()

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s real rows (for metrics; a host sync unless ``all_real``)."""
        return x if self.all_real else x[self.real]


class Task:
    """Subclass and override ``train_loss`` and ``eval_step`` (and ``metrics``).

    - ``train_loss(model, batch)``: (loss summed over the real rows, their count), both device
      tensors; the loop divides one by the other, so the mean is exact with padding and
      gradient accumulation and needs no host sync.
    - ``eval_step(model, batch, metrics)``: update ``metrics`` (a torchmetrics
      MetricCollection: ``metrics.update(preds, target)``) with the real rows; return the same
      (loss sum, count).
    - ``metrics()``: the default metrics, name -> a ``torchmetrics.Metric`` or a
      ``{_target_: ...}`` mapping; ``task.metrics`` adds to them. ``task.monitor`` names the one
      that picks best.pt (``loss`` is always there).
    - ``output_shape(n)``: the model's output shape for ``n`` images (of ``logits(out)``),
      checked before the first step on ``blank_inputs`` and ``blank_target``; None skips
      the check.
      ``num_outputs()``: the model's ``num_classes`` argument (None: ``data.num_classes``),
      one for a regression, say. ``draw(...)``: a picture of predictions (segmentation's).
    """

    def train_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def eval_step(
        self, model: nn.Module, batch: Batch, metrics: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def metrics(self) -> dict[str, Any]:
        return {}

    def output_shape(self, n: int) -> tuple[int, ...] | None:
        return None

    def num_outputs(self) -> int | None:
        """What the model is built with as ``num_classes``; None: ``data.num_classes``."""
        return None

    def output_keys(self) -> str:
        """The config keys that decide ``output_shape``, for its error message."""
        return "the task"

    def logits(self, out: Any) -> Any:
        """The part of the model's output that ``output_shape`` describes (a segmentation
        model's dict: its ``out``)."""
        return out

    def blank_inputs(self, n: int, data: Any, device: torch.device,
                     memory_format: torch.memory_format) -> torch.Tensor:  # fmt: skip
        """``PROBE_BATCH`` blank inputs of the data's shape (black images), for the check."""
        return blank_images(data, data.image_size, device, memory_format)

    def blank_target(self, n: int, size: int, device: torch.device) -> torch.Tensor:
        """A target for ``n`` blank images of ``size`` pixels (the check before training)."""
        return torch.zeros(n, dtype=torch.long, device=device)

    def draw(self, model: nn.Module, dataset: Any, preprocess: nn.Module, device: torch.device,
             classes: list[str] | None, out_dir: Path) -> Path | None:  # fmt: skip
        """A picture of the model's predictions in ``out_dir`` (main rank, after training and
        in eval.py); None draws nothing."""
        return None
