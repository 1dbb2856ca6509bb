"""Tasks: the training objective behind ``task=...``; ``build_task`` is the front door.

``task=classification`` (the default) is cross-entropy with torchmetrics' classification
metrics; ``task=custom task._target_=pkg.module.MyTask +task.NAME=VALUE`` builds your own
``Task`` subclass (``ddp_utils.tasks.base``) with Hydra's ``instantiate``.
"""

from __future__ import annotations

from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn

from ddp_utils.config import ConfigError, TrainConfig
from ddp_utils.models import memory_format_of
from ddp_utils.models.probe import PROBE_BATCH, check_output
from ddp_utils.targets import target_arguments, why
from ddp_utils.tasks.base import Batch, Task

__all__ = ["Batch", "Task", "build_task", "check_task"]

REQUIRED = ("train_loss", "eval_step")
CLASSIFICATION_ONLY = {  # options that only mean something for class labels
    "data.mixup_alpha": lambda c: c.data.mixup_alpha > 0,
    "data.cutmix_alpha": lambda c: c.data.cutmix_alpha > 0,
    "trainer.label_smoothing": lambda c: c.trainer.label_smoothing > 0,
}


def build_task(cfg: TrainConfig) -> Task:
    """The task of ``task._target_``, given what its signature takes of ``num_classes``,
    ``in_channels`` and ``image_size`` (and, for classification, the loss options)."""
    t = cfg.task
    if t.name != "classification":
        used = [key for key, on in CLASSIFICATION_ONLY.items() if on(cfg)]
        if used:
            raise ConfigError(
                f"{', '.join(used)} only apply to task=classification (this is task={t.name}); "
                "set them to 0."
            )
    offered: dict[str, Any] = {
        "num_classes": cfg.data.num_classes, "in_channels": cfg.data.in_channels,
        "image_size": cfg.data.image_size,
    }  # fmt: skip
    if t.name == "classification":
        from ddp_utils.tasks.classification import build_mixing

        offered |= {"label_smoothing": cfg.trainer.label_smoothing,
                    "mixing": build_mixing(cfg.data)}  # fmt: skip
    args = target_arguments("task._target_", t._target_, offered, t.kwargs)
    try:
        task = instantiate({"_target_": t._target_, "_convert_": "all"}, **args)
    except InstantiationException as e:
        raise ConfigError(
            f"task._target_={t._target_} rejected its arguments {sorted(args)} ({why(e)}). "
            "Fix the +task.NAME=VALUE overrides."
        ) from None
    missing = [m for m in REQUIRED if getattr(type(task), m, None) in (None, getattr(Task, m))]
    if missing:
        raise ConfigError(
            f"task._target_={t._target_} has no {' or '.join(missing)}: subclass "
            "ddp_utils.tasks.Task and define train_loss(model, batch) and "
            "eval_step(model, batch, metrics) (the README's custom task shows both)."
        )
    return task


class _NamedUpdates:
    """Stands in for the MetricCollection during ``check_task``: updates each metric on its
    own, so that one that fails is named."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    def update(self, *args: Any, **kwargs: Any) -> None:
        for name, metric in self.metrics.items(keep_base=True):
            try:
                metric.update(*args, **kwargs)
            except Exception as e:
                lines = str(e).strip().splitlines()
                raise ConfigError(
                    f"task.metrics.{name} ({type(metric).__name__}) cannot take this task's "
                    f"batches ({type(e).__name__}: {lines[-1][:300] if lines else ''}). Fix its "
                    f"arguments (+task.metrics.{name}.num_classes='${{data.num_classes}}', say)."
                ) from None


@torch.no_grad()
def check_task(
    task: Task, model: nn.Module, metrics: Any, cfg: TrainConfig, device: torch.device
) -> None:
    """Before the first step (and in eval.py), on blank images of the data's shape: the
    model's output has the task's shape and takes ``data.image_size``, and one ``eval_step``
    updates every metric; then the metrics are reset. Eval mode: nothing moves."""
    memory_format = memory_format_of(cfg.trainer.channels_last)
    expected = task.output_shape(PROBE_BATCH)
    if expected is not None:
        check_output(model, cfg.model, cfg.data, device, memory_format, expected,
                     task.output_keys())  # fmt: skip
    d = cfg.data
    blank = torch.zeros(PROBE_BATCH, d.in_channels, d.image_size, d.image_size, device=device)
    labels = torch.zeros(PROBE_BATCH, dtype=torch.long, device=device)
    batch = Batch(blank.contiguous(memory_format=memory_format), labels, all_real=True)
    was_training = model.training
    model.eval()
    try:
        task.eval_step(model, batch, _NamedUpdates(metrics))
    finally:
        model.train(was_training)
        metrics.reset()
