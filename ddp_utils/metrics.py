"""Exact distributed evaluation with torchmetrics: every sample on exactly one rank, one sync.

Each rank scores its own shard (``EvalShardSampler``: every sample on exactly one rank, no
padding) into a ``torchmetrics.MetricCollection`` on its device; ranks may hold different
numbers of batches, so nothing is synchronised per batch. After the last batch every rank calls
``compute()``, torchmetrics' own sync (an all_gather of each metric's states), and one
all_reduce adds the loss sum and the sample counts. Without padded duplicates, every metric,
also one that keeps every sample's score (AUROC), is the one-process number at any world size.

The metrics are ``task.metrics`` on top of the task's defaults: any ``torchmetrics.Metric``
(or a user's subclass) given as a ``_target_``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import Metric, MetricCollection

from ddp_utils.config import ConfigError, TaskConfig
from ddp_utils.dist import Runtime, all_reduce_max, all_reduce_sum
from ddp_utils.targets import why
from ddp_utils.tasks import Task
from ddp_utils.watchdog import StepWatchdog


def build_metric(name: str, spec: Any) -> Metric:
    """``task.metrics.NAME``: instantiate its ``_target_`` (a task's default may be a Metric
    already); mistakes name the key."""
    if isinstance(spec, Metric):
        return spec
    where = f"task.metrics.{name}"
    if not isinstance(spec, Mapping) or "_target_" not in spec:
        raise ConfigError(
            f"{where} needs a _target_: +{where}._target_=torchmetrics.classification."
            f"MulticlassAUROC (any torchmetrics.Metric), or {where}=null to drop it."
        )
    try:
        metric = instantiate(dict(spec), _convert_="all")
    except InstantiationException as e:
        text = why(e)
        if "Error locating target" in str(e) or isinstance(e.__cause__, ImportError):
            raise ConfigError(
                f"{where}._target_={spec['_target_']} cannot be imported ({text}). Check the "
                "dotted path (e.g. torchmetrics.classification.MulticlassAUROC)."
            ) from None
        raise ConfigError(
            f"{where}: {spec['_target_']} rejected its arguments "
            f"{sorted(k for k in spec if k != '_target_')} ({text}). Fix +{where}.ARG=VALUE."
        ) from None
    if not isinstance(metric, Metric):
        raise ConfigError(
            f"{where}._target_={spec['_target_']} built a {type(metric).__name__}, not a "
            "torchmetrics.Metric."
        )
    return metric


def build_metrics(cfg: TaskConfig, task: Task, device: torch.device) -> MetricCollection:
    """The task's default metrics with ``task.metrics`` on top, as one collection; checks that
    ``task.monitor`` is among them (or is ``loss``)."""
    specs = {**task.metrics(), **cfg.metrics}
    metrics = {name: build_metric(name, spec) for name, spec in specs.items() if spec is not None}
    if cfg.monitor != "loss" and cfg.monitor not in metrics:
        raise ConfigError(
            f"task.monitor={cfg.monitor} is not among the metrics ({', '.join(sorted(metrics))}"
            ", loss): pick one of those, or add it as +task.metrics."
            f"{cfg.monitor}._target_=..."
        )
    # compute_groups=False: each metric keeps its own states (no merging guessed at run time).
    return MetricCollection(metrics, compute_groups=False).to(device)


def lockstep_rounds(batches: int, rt: Runtime) -> int:
    """The most batches any rank's shard holds; ConfigError on every rank when some rank has
    none (it would have no batch to repeat)."""
    most, fewest = all_reduce_max(torch.tensor([batches, -batches], device=rt.device)).tolist()
    if most and not -fewest:
        raise ConfigError(
            f"the evaluation set leaves a rank without a batch at world size {rt.world_size}, "
            "and a sharded model needs every rank in every forward: evaluate on fewer "
            "processes, or with a larger set."
        )
    return int(most)


class CountMismatchError(RuntimeError):
    """The evaluation counted a different number of samples than the set holds."""


def _plain(value: torch.Tensor) -> float | list:
    """A computed metric for JSON: a scalar, a vector (per class) or a matrix."""
    value = value.detach().cpu()
    return value.item() if value.ndim == 0 else value.tolist()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    preprocess: nn.Module,
    rt: Runtime,
    task: Task,
    metrics: MetricCollection,
    amp: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    watchdog: StepWatchdog | None = None,
    skip_bad: bool = False,
    lockstep: bool = False,
) -> dict[str, Any]:
    """Score ``model`` (the unwrapped module) on the sharded ``loader``; same result on all ranks.

    The unwrapped model is used on purpose: a DDP forward may broadcast buffers, a collective
    that would deadlock when ranks hold different numbers of batches. ``watchdog`` times each
    batch (not the final sync, where a rank waits for a slower one). ``task.eval_step`` updates
    the metrics and gives the loss; with ``skip_bad`` unreadable images (``BAD_LABEL``) may be
    in a batch: they are counted apart and kept out of both. With ``lockstep`` (a sharded
    model, whose every forward is a collective) a rank whose shard ends early repeats its last
    batch's forward, uncounted (``task.idle_forward``), until every rank is done.
    """
    was_training = model.training
    model.eval()
    metrics.reset()
    # loss sum, its count (samples, or pixels), skipped images, samples
    totals = torch.zeros(4, dtype=torch.float64, device=rt.device)
    beat = watchdog.beat if watchdog is not None else lambda phase: None
    beat("val")
    rounds = lockstep_rounds(len(loader), rt) if lockstep else len(loader)
    batch = None
    for images, target in loader:
        # Skipped images are counted apart, left out of the loss and the metrics.
        batch = task.to_batch(images, target, rt.device, preprocess, skip_bad, not skip_bad)
        with amp():
            loss_sum, n = task.eval_step(model, batch, metrics)
        # Evaluation shards hold no padding: every row is a sample, but for a skipped image.
        n_bad = torch.as_tensor(batch.skipped, device=rt.device)
        totals += torch.stack([loss_sum.double(), n.double(), n_bad.double(),
                               (batch.size - n_bad).double()])  # fmt: skip
        beat("val")
    for _ in range(rounds - len(loader)):
        with amp():
            task.idle_forward(model, batch)
    if watchdog is not None:
        watchdog.disarm()
    computed = metrics.compute()  # torchmetrics' sync: every rank reaches it
    loss_sum, n, skipped, samples = all_reduce_sum(totals).tolist()
    model.train(was_training)
    result: dict[str, Any] = {name: _plain(value) for name, value in computed.items()}
    result |= {"loss": loss_sum / max(n, 1), "num_samples": int(samples),
               "skipped_images": int(skipped)}  # fmt: skip
    expected = len(loader.dataset)
    if result["num_samples"] + result["skipped_images"] != expected:
        raise CountMismatchError(
            f"evaluation counted {result['num_samples']} predictions and "
            f"{result['skipped_images']} skipped images for a set of {expected}"
        )
    return result


def scalars(result: dict[str, Any]) -> dict[str, float]:
    """The numbers of a result that go to metrics.jsonl and TensorBoard (vectors do not)."""
    return {
        k: v for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
