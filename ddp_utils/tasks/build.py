"""``build_task``: the task option's ``_target_`` instantiated with what the data offers, and
``check_task``: one probe batch through the model, the loss and the metrics before a run
starts, so that a mismatch is one message naming the keys."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn

from ddp_utils.config import ConfigError, TrainConfig, UserError, own_keys
from ddp_utils.data import offered_by_data
from ddp_utils.dist import Runtime
from ddp_utils.flops import counting
from ddp_utils.instantiate import target_arguments, why
from ddp_utils.logs import log
from ddp_utils.models import memory_format_of
from ddp_utils.models.probe import PROBE_BATCH, check_logits, eval_mode, size_error
from ddp_utils.tasks.base import Batch, Task

REQUIRED = ("train_loss", "eval_step")
LABEL_OPTIONS = {  # options that only mean something for class labels
    "data.mixup_alpha": lambda c: c.data.mixup_alpha > 0,
    "data.cutmix_alpha": lambda c: c.data.cutmix_alpha > 0,
    "trainer.label_smoothing": lambda c: c.trainer.label_smoothing > 0,
}


def build_task(cfg: TrainConfig) -> Task:
    """The task of ``task._target_``, given what its signature takes of ``num_classes``,
    ``in_channels`` and ``image_size`` (token data: ``vocab_size``, ``block_size`` and
    ``token_bytes``; classification: the loss options)."""
    t = cfg.task
    offered = offered_by_data(cfg.data)
    offered |= {k: getattr(t, k) for k in own_keys(type(t), "task") if k != "kwargs"}
    if type(t).label_options:
        from ddp_utils.tasks.classification import label_arguments

        offered |= label_arguments(cfg)
    else:
        used = [key for key, on in LABEL_OPTIONS.items() if on(cfg)]
        if used:
            raise ConfigError(
                f"{', '.join(used)} only apply to task=classification (this is task={t.name}); "
                "set them to 0."
            )
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
            "eval_step(model, batch, metrics) (docs/extend/task.md shows both)."
        )
    return task


class _NamedUpdates:
    """Stands in for the MetricCollection during ``check_task``: updates each metric on its
    own, so that one that fails is named."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    def update(self, *args: Any, **kwargs: Any) -> None:
        for name, metric in self.metrics.items(keep_base=True):
            _NamedUpdates.one(name, metric, args, kwargs)

    def __getitem__(self, name: str) -> Any:
        """One metric (a task that feeds each its own values): its update is checked alone."""
        metric = self.metrics[name]
        return SimpleNamespace(update=lambda *a, **kw: _NamedUpdates.one(name, metric, a, kw))

    @staticmethod
    def one(name: str, metric: Any, args: tuple, kwargs: dict) -> None:
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


def blank_batch(task: Task, cfg: TrainConfig, device: torch.device, n: int = 1) -> Batch:
    """``n`` blank samples of the data's shape, as the task feeds them to the model."""
    memory_format = memory_format_of(cfg.trainer.channels_last)
    inputs = task.blank_inputs(n, cfg.data, device, memory_format)
    return Batch(inputs, task.blank_target(n, cfg.data.image_size, device), True)


def check_task(
    task: Task,
    model: nn.Module,
    metrics: Any,
    cfg: TrainConfig,
    device: torch.device,
    amp: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> float:
    """Before the first step (and in eval.py), one ``eval_step`` on blank images of the data's
    shape, in eval mode (nothing moves): the model takes ``data.image_size``, its output has the
    task's shape, and every metric takes the batch; then the metrics are reset. Under ``amp``
    (training's autocast): the forward runs as training's and validation's do (a sharded
    model's parameters are already in the autocast dtype). Returns the forward's FLOPs a
    sample, counted as it ran (``ddp_utils.flops``)."""
    memory_format = memory_format_of(cfg.trainer.channels_last)
    expected = task.output_shape(PROBE_BATCH)

    def check(out: Any) -> None:
        if expected is not None:
            check_logits(task.logits(out), cfg.model, cfg.data, expected, task.output_keys())

    checked = _Checked(model, check)
    batch = blank_batch(task, cfg, device, PROBE_BATCH)
    inputs = batch.inputs
    try:
        with eval_mode(model), amp():
            with counting() as counter:
                returned = task.eval_step(checked, batch, _NamedUpdates(metrics))
            check_sums(task, model, batch, metrics, returned)
    except UserError:
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
    return counter.get_total_flops() / PROBE_BATCH


CONTRACT = ("return (the loss summed over the batch's real rows, their count): two tensors, "
            "the loop divides one by the other (docs/extend/task.md)")  # fmt: skip


def shown(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}: ({', '.join(shown(v) for v in x)})"
    return "None" if x is None else f"{type(x).__name__} {str(x)[:40]}"


def loss_and_count(task: Task, method: str, returned: Any) -> tuple[float, float]:
    """A ``train_loss`` / ``eval_step`` return as numbers, or ConfigError naming the method and
    what it returned."""
    name = f"{type(task).__name__}.{method}"
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        raise ConfigError(f"{name} returned {shown(returned)}, not a pair; {CONTRACT}.")
    loss, count = returned
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        raise ConfigError(f"{name} returned {shown(loss)} as its loss, not one number (a "
                          f"value per sample? sum it); {CONTRACT}.")  # fmt: skip
    if not (isinstance(count, torch.Tensor) and count.numel() == 1):
        raise ConfigError(f"{name} returned {shown(count)} as its count, not one number "
                          f"(batch.count() gives it); {CONTRACT}.")  # fmt: skip
    return float(loss), float(count)


def doubled(batch: Batch) -> Batch | None:
    """The batch with each row twice (None where its parts are neither plain tensors nor a
    list of per-sample targets)."""
    if not isinstance(batch.inputs, torch.Tensor):
        return None
    if isinstance(batch.target, torch.Tensor):
        return Batch(torch.cat([batch.inputs] * 2), torch.cat([batch.target] * 2), batch.all_real)
    if isinstance(batch.target, list):
        return Batch(torch.cat([batch.inputs] * 2), batch.target * 2, batch.all_real)
    return None


def check_sums(task: Task, model: nn.Module, batch: Batch, metrics: Any,
               evaluated: Any) -> None:  # fmt: skip
    """Both methods on the blank batch (``evaluated``: eval_step's return for it) and on it
    doubled (every row the same, in eval mode): a sum and a count double, a mean stays put,
    the mistake that would train on a wrongly weighted loss and average the metric wrongly
    without any error."""
    twice = doubled(batch)
    calls = {"train_loss": lambda b: task.train_loss(model, b),
             "eval_step": lambda b: task.eval_step(model, b, metrics)}  # fmt: skip
    for method, call in calls.items():
        if method == "train_loss" and not task.loss_in_eval_mode:
            continue
        returned = evaluated if method == "eval_step" else call(batch)
        loss, count = loss_and_count(task, method, returned)
        if twice is None:
            continue
        loss2, count2 = loss_and_count(task, method, call(twice))
        name = f"{type(task).__name__}.{method}"
        if count2 != 2 * count:
            raise ConfigError(f"{name}'s count went from {count:g} to {count2:g} when the batch "
                              f"doubled, not to {2 * count:g}: {CONTRACT}.")  # fmt: skip
        if loss != 0 and not math.isclose(loss2, 2 * loss, rel_tol=1e-3):
            raise ConfigError(
                f"{name}'s loss stayed {loss:.4g} -> {loss2:.4g} when the batch of identical "
                f"rows doubled (a sum doubles): it returns a mean. {CONTRACT[0].upper()}"
                f"{CONTRACT[1:]}, so means are exact over ranks and accumulation steps."
            )


def draw_predictions(task: Task, model: nn.Module, dataset: Any, preprocess: nn.Module,
                     rt: Runtime, classes: list[str] | None, out_dir: Path) -> None:  # fmt: skip
    """The main rank draws the task's picture of predictions (``Task.draw``) into
    ``out_dir``; a full disk raises as every other write does (the caller reports it)."""
    if not rt.is_main:
        return
    path = task.draw(model, dataset, preprocess, rt.device, classes, out_dir)
    if path is not None:
        log.info("predictions drawn into %s", path)
