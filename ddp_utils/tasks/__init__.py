"""Tasks: the training objective behind ``task=...``; ``build_task`` is the front door.

``task=classification`` (the default) is cross-entropy with torchmetrics' classification
metrics; ``task=custom task._target_=pkg.module.MyTask +task.NAME=VALUE`` builds your own
``Task`` subclass (``ddp_utils.tasks.base``) with Hydra's ``instantiate``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn

from ddp_utils.config import ConfigError, TrainConfig, own_keys
from ddp_utils.data import offered_by_data
from ddp_utils.dist import Runtime
from ddp_utils.models import memory_format_of
from ddp_utils.models.probe import PROBE_BATCH, check_logits, eval_mode, size_error
from ddp_utils.run import log
from ddp_utils.targets import target_arguments, why
from ddp_utils.tasks.base import Batch, Task

__all__ = ["Batch", "Task", "build_task", "check_task", "draw_predictions"]

REQUIRED = ("train_loss", "eval_step")
CLASSIFICATION_ONLY = {  # options that only mean something for class labels
    "data.mixup_alpha": lambda c: c.data.mixup_alpha > 0,
    "data.cutmix_alpha": lambda c: c.data.cutmix_alpha > 0,
    "trainer.label_smoothing": lambda c: c.trainer.label_smoothing > 0,
}


def build_task(cfg: TrainConfig) -> Task:
    """The task of ``task._target_``, given what its signature takes of ``num_classes``,
    ``in_channels`` and ``image_size`` (token data: ``vocab_size``, ``block_size`` and
    ``token_bytes``; classification: the loss options)."""
    t = cfg.task
    if t.name != "classification":
        used = [key for key, on in CLASSIFICATION_ONLY.items() if on(cfg)]
        if used:
            raise ConfigError(
                f"{', '.join(used)} only apply to task=classification (this is task={t.name}); "
                "set them to 0."
            )
    offered = offered_by_data(cfg.data)
    offered |= {k: getattr(t, k) for k in own_keys(type(t), "task") if k != "kwargs"}
    if t.name == "classification":
        from ddp_utils.tasks.classification import build_mixing

        offered |= {"label_smoothing": cfg.trainer.label_smoothing,
                    "mixing": build_mixing(cfg.data)}  # fmt: skip
    args = target_arguments("task._target_", t._target_, offered, getattr(t, "kwargs", {}))
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
                raise ConfigError(
                    f"task.metrics.{name} ({type(metric).__name__}) cannot take this task's "
                    f"batches ({why(e)}). Fix its arguments "
                    f"(+task.metrics.{name}.num_classes='${{data.num_classes}}', say)."
                ) from None


class _Checked(nn.Module):
    """The model during ``check_task``: its output is checked against the task's shape as soon
    as it is made, before any metric sees it."""

    def __init__(self, model: nn.Module, check: Callable[[Any], None]) -> None:
        super().__init__()
        self.model, self.check, self.ran = model, check, False

    def forward(self, x: torch.Tensor) -> Any:
        out = self.model(x)
        self.ran = True
        self.check(out)
        return out


def check_task(
    task: Task, model: nn.Module, metrics: Any, cfg: TrainConfig, device: torch.device
) -> None:
    """Before the first step (and in eval.py), one ``eval_step`` on blank images of the data's
    shape, in eval mode (nothing moves): the model takes ``data.image_size``, its output has the
    task's shape, and every metric takes the batch; then the metrics are reset."""
    memory_format = memory_format_of(cfg.trainer.channels_last)
    expected = task.output_shape(PROBE_BATCH)

    def check(out: Any) -> None:
        if expected is not None:
            check_logits(task.logits(out), cfg.model, cfg.data, expected, task.output_keys())

    checked = _Checked(model, check)
    inputs = task.blank_inputs(PROBE_BATCH, cfg.data, device, memory_format)
    target = task.blank_target(PROBE_BATCH, cfg.data.image_size, device)
    batch = Batch(inputs, target, True)
    try:
        with eval_mode(model):
            task.eval_step(checked, batch, _NamedUpdates(metrics))
    except ConfigError:
        raise
    except Exception as e:
        if checked.ran or inputs.ndim != 4:
            raise  # the model ran (a bug in the task), or no image size to try
        error = size_error(model, cfg.model, cfg.data, device, memory_format, e)
        if error is None:
            raise  # no size helps: a bug in the model, with its traceback
        raise error from None
    finally:
        metrics.reset()


def draw_predictions(task: Task, model: nn.Module, dataset: Any, preprocess: nn.Module,
                     rt: Runtime, classes: list[str] | None, out_dir: Path) -> None:  # fmt: skip
    """The main rank draws the task's picture of predictions (``Task.draw``) into
    ``out_dir``; a full disk raises as every other write does (the caller reports it)."""
    if not rt.is_main:
        return
    path = task.draw(model, dataset, preprocess, rt.device, classes, out_dir)
    if path is not None:
        log.info("predictions drawn into %s", path)
