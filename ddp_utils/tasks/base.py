"""The task protocol: what differs between training objectives, and nothing else.

The loop, resume, checkpoints, EMA, precision, compile, the non-finite stop and the callbacks
know nothing of the task; they call ``train_loss`` for every micro-batch and evaluation calls
``eval_step`` for every batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_utils.data.samplers import BAD_LABEL, IGNORE_LABEL, SENTINEL
from ddp_utils.models.probe import blank_images


def to_device(target: Any, device: torch.device) -> Any:
    """A target of any shape with its tensors on ``device``: a tensor, a dict of tensors, or
    a list of per-sample dicts (boxes of different lengths)."""
    if isinstance(target, torch.Tensor):
        return target.to(device, non_blocking=True)
    if isinstance(target, Mapping):
        return {k: to_device(v, device) for k, v in target.items()}
    if isinstance(target, list | tuple):
        return [to_device(v, device) for v in target]
    return target


def sentinel_of(sample: Any) -> int | None:
    """A per-sample dict target's sentinel (``IGNORE_LABEL``, ``BAD_LABEL``), if it is one."""
    return sample.get(SENTINEL) if isinstance(sample, Mapping) else None


@dataclass
class Batch:
    """One device batch: ``inputs`` preprocessed (normalised, augmented) and ``target``, one of
    - a tensor of labels (or masks, or token ids), ``IGNORE_LABEL`` where a row (pixel, token)
      is not counted: a padding duplicate at an epoch's end, a skipped unreadable image;
    - a list of per-sample dicts (torchvision detection's layout: boxes of varying length), a
      sample that is not counted being ``{SENTINEL: IGNORE_LABEL}``;
    - a dict of batched tensors (every row counted).
    Sums over ``real`` rows make means exact at any world size."""

    inputs: Any
    target: Any
    all_real: bool = False  # known to hold no padding and no skipped image: no mask needed
    skipped: torch.Tensor | int = 0  # unreadable images in it (data.skip_bad_images)

    @property
    def size(self) -> int:
        """The number of samples (rows), real or not."""
        if isinstance(self.target, Mapping):
            return len(next(iter(self.target.values())))
        return len(self.target)

    @property
    def real(self) -> torch.Tensor:
        """A bool mask of the real rows (elements, for a tensor target; samples, for a list)."""
        if isinstance(self.target, torch.Tensor):
            return self.target != IGNORE_LABEL
        first = self.inputs if isinstance(self.inputs, torch.Tensor) else self.inputs[0]
        device = first.device if isinstance(first, torch.Tensor) else None
        if isinstance(self.target, Mapping):
            return torch.ones(self.size, dtype=torch.bool, device=device)
        flags = [sentinel_of(t) is None for t in self.target]
        return torch.tensor(flags, dtype=torch.bool, device=device)

    def count(self) -> torch.Tensor:
        """The number of real rows (real pixels for a mask target), on the device."""
        return self.real.sum()

    def select(self, x: Any) -> Any:
        """``x``'s real rows (for metrics; a host sync unless ``all_real``): a tensor indexed
        by the mask, or a list (per-sample dicts) filtered."""
        if self.all_real:
            return x
        if isinstance(x, torch.Tensor):
            return x[self.real]
        return [v for v, keep in zip(x, self.real.tolist(), strict=True) if keep]


class Task:
    """Subclass and override ``train_loss`` and ``eval_step`` (and ``metrics``).

    - ``to_batch(images, target, ...)``: a loader item as a ``Batch`` on the device; the
      default moves a target of any shape (tensor, dict, list of per-sample dicts).

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

    # Whether train_loss runs on a model in eval mode, where the check before the first step
    # calls it (nothing moves there); torchvision's detectors make losses in training mode only.
    loss_in_eval_mode: bool = True
    # Whether every batch's inputs have one shape: cuDNN's autotuning pays off only then (a
    # new shape is tuned anew); detection's images keep their own sizes.
    fixed_input_shapes: bool = True
    # What of the task's models has no deterministic CUDA kernel (torch only warns for it
    # under trainer.deterministic=true): named in the run's first lines; None: nothing known.
    nondeterministic_on_cuda: str | None = None

    def to_batch(self, images: Any, target: Any, device: torch.device, preprocess: nn.Module,
                 skip_bad: bool = False, all_real: bool = False) -> Batch:  # fmt: skip
        """A loader's item as a device batch: the images preprocessed, the target's tensors
        moved. With ``skip_bad`` unreadable images (``BAD_LABEL``) are counted in
        ``Batch.skipped`` and marked not real."""
        inputs = preprocess(images.to(device, non_blocking=True))
        target, skipped = to_device(target, device), 0
        if skip_bad and isinstance(target, torch.Tensor):
            bad = target == BAD_LABEL
            skipped = bad.reshape(len(target), -1).all(1).sum()
            target = torch.where(bad, IGNORE_LABEL, target)
        elif skip_bad and isinstance(target, list):
            skipped = sum(sentinel_of(t) == BAD_LABEL for t in target)
        return Batch(inputs, target, all_real, skipped)

    def train_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def eval_step(
        self, model: nn.Module, batch: Batch, metrics: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def eval_forwards(self, n: int) -> int:
        """How many forwards ``eval_step`` runs on a batch of ``n`` samples, skipped ones
        included: a sharded model's lockstep evaluation pads every rank to the most."""
        return 1

    def idle_forward(self, model: nn.Module, batch: Batch) -> None:
        """One forward of ``batch`` (or of a part of it), its output dropped: a rank whose
        evaluation shard ended early keeps a sharded model's collectives in step with it."""
        model(batch.inputs)

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

    @property
    def draws(self) -> bool:
        """Whether ``draw`` draws anything (a sharded model is gathered whole for it)."""
        return type(self).draw is not Task.draw
