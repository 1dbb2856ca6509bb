"""Exact distributed evaluation with torchmetrics: the same numbers, to the last digit, at
any world size.

Each rank scores its canonical batches (``EvalShardSampler``: the data set's order cut into
batches, batch ``k`` on rank ``k % W``), so every batch, and each sample's output, is the
one-process one. ``BatchOrder`` then puts the batches' results back in batch order: the
states that a float sum or a list holds (the loss, a mean, perplexity's log-probabilities,
AUROC's scores, mAP's detections) are kept per batch and joined in the data set's order on
every rank; counts (integer sums), maxima and minima are order-free and reduced once. A
metric with a state of another reduction (``mean``, a function of its own) is left to
torchmetrics' own sync.

The metrics are ``task.metrics`` on top of the task's defaults: any ``torchmetrics.Metric``
(or a user's subclass) given as a ``_target_``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum

from ddp_utils.config import ConfigError, TaskConfig
from ddp_utils.data.samplers import EvalShardSampler
from ddp_utils.dist import Runtime, all_reduce_max
from ddp_utils.instantiate import why
from ddp_utils.lifecycle.watchdog import StepWatchdog
from ddp_utils.tasks.base import Batch, Task


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


def lockstep_pad(loader: Any, task: Task, rt: Runtime) -> int:
    """How many forwards this rank adds after its shard so that every rank runs as many as the
    busiest (a sharded model's every forward is a collective): from each rank's canonical
    batch sizes, before any forward."""
    sampler = getattr(loader, "sampler", None)
    sizes = sampler.batch_sizes() if isinstance(sampler, EvalShardSampler) else [1] * len(loader)
    mine = sum(task.eval_forwards(n) for n in sizes)
    return int(all_reduce_max(torch.tensor([mine], device=rt.device)).item()) - mine


_ORDER_FREE = {dim_zero_max: dist.ReduceOp.MAX, dim_zero_min: dist.ReduceOp.MIN}


def _cpu(x: Any) -> Any:
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


class BatchOrder:
    """The metrics' states and the loss totals of every rank's batches, joined in the data
    set's batch order on every rank (see the module's docstring).

    ``start_batch`` before each batch's update hands each ordered state a fresh default, and
    ``end_batch`` keeps what the batch put there; ``join`` (every rank) gathers those, adds
    them (or concatenates lists) batch by batch from the first, and leaves every metric ready
    for a ``compute()`` without its own sync.
    """

    def __init__(self, metrics: MetricCollection) -> None:
        self.ordered: list[tuple[Metric, str]] = []  # float sums and lists: kept per batch
        self.reduced: list[tuple[Metric, str, dist.ReduceOp]] = []  # order-free: reduced once
        self.own_sync: list[Metric] = []
        for _, metric in metrics.items(keep_base=True):
            ordered, reduced = [], []
            for attr, default in metric._defaults.items():
                reduction = metric._reductions[attr]
                if isinstance(default, list) or (
                    reduction is dim_zero_sum and default.is_floating_point()
                ):
                    ordered.append((metric, attr))
                elif reduction is dim_zero_sum:
                    reduced.append((metric, attr, dist.ReduceOp.SUM))
                elif reduction in _ORDER_FREE:
                    reduced.append((metric, attr, _ORDER_FREE[reduction]))
                else:
                    self.own_sync.append(metric)
                    break
            else:
                self.ordered += ordered
                self.reduced += reduced
        self.batches: list[int] = []
        self.parts: list[list[Any]] = []

    def start_batch(self) -> None:
        for metric, attr in self.ordered:
            default = metric._defaults[attr]
            fresh = [] if isinstance(default, list) else default.to(metric.device, copy=True)
            setattr(metric, attr, fresh)

    def end_batch(self, k: int, totals: torch.Tensor) -> None:
        """Batch ``k`` (canonical number) is scored; ``totals`` are its loss and counts."""
        self.batches.append(k)
        self.parts.append([totals] + [getattr(m, attr) for m, attr in self.ordered])

    def join(self, world_size: int) -> torch.Tensor:
        """Every rank: the joined states set on the metrics; returns the summed totals."""
        for metric, attr, op in self.reduced:
            if world_size > 1:
                dist.all_reduce(getattr(metric, attr), op=op)
        mine = (self.batches, [[[_cpu(x) for x in p] if isinstance(p, list) else _cpu(p)
                                for p in parts] for parts in self.parts])  # fmt: skip
        gathered: list[Any] = [None] * world_size
        if world_size > 1:
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        in_order = sorted(((k, parts) for batches, parts_list in gathered
                           for k, parts in zip(batches, parts_list, strict=True)),
                          key=lambda kp: kp[0])  # fmt: skip
        joined: list[Any] = [None] * (1 + len(self.ordered))
        for _, parts in in_order:
            for i, part in enumerate(parts):
                if isinstance(part, list):
                    joined[i] = (joined[i] or []) + part
                else:
                    joined[i] = part if joined[i] is None else joined[i] + part
        for (metric, attr), value in zip(self.ordered, joined[1:], strict=True):
            if value is None:  # no batch anywhere
                value = metric._defaults[attr]
            to = metric.device
            setattr(metric, attr, [_to(x, to) for x in value] if isinstance(value, list)
                    else value.to(to))  # fmt: skip
        return joined[0] if joined[0] is not None else torch.zeros(4, dtype=torch.float64)

    def compute(self, metrics: MetricCollection) -> dict[str, Any]:
        """``metrics.compute()`` on the joined states: torchmetrics' sync only for the metrics
        left to it."""
        # By identity: a Metric's == builds a compositional metric.
        own = {id(m) for m in self.own_sync}
        synced = [m for _, m in metrics.items(keep_base=True) if id(m) not in own]
        for metric in synced:
            metric._to_sync = False
        try:
            return metrics.compute()
        finally:
            for metric in synced:
                metric._to_sync = metric.sync_on_compute


def _to(x: Any, device: torch.device) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x


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
    blank: Callable[[], Batch] | None = None,
) -> dict[str, Any]:
    """Score ``model`` (the unwrapped module) on the sharded ``loader``; same result on all ranks.

    The unwrapped model is used on purpose: a DDP forward may broadcast buffers, a collective
    that would deadlock when ranks hold different numbers of batches. ``watchdog`` times each
    batch (not the final sync, where a rank waits for a slower one). ``task.eval_step`` updates
    the metrics and gives the loss; with ``skip_bad`` unreadable images (``BAD_LABEL``) may be
    in a batch: they are counted apart and kept out of both. With ``lockstep`` (a sharded
    model, whose every forward is a collective) a rank whose shard ends early runs forwards of
    its last batch (or of ``blank()``'s, with none), uncounted (``task.idle_forward``), until
    every rank has run as many.
    """
    was_training = model.training
    model.eval()
    metrics.reset()
    order = BatchOrder(metrics)
    beat = watchdog.beat if watchdog is not None else lambda phase: None
    beat("val")
    pad = lockstep_pad(loader, task, rt) if lockstep else 0
    batch = None
    for j, (images, target) in enumerate(loader):
        # Skipped images are counted apart, left out of the loss and the metrics.
        batch = task.to_batch(images, target, rt.device, preprocess, skip_bad, not skip_bad)
        order.start_batch()
        with amp():
            loss_sum, n = task.eval_step(model, batch, metrics)
        # Evaluation shards hold no padding: every row is a sample, but for a skipped image.
        # A count on the host becomes a fill on the device: no copy, so no wait for the stream.
        n_bad = batch.skipped if torch.is_tensor(batch.skipped) else loss_sum.new_full(
            (), batch.skipped)  # fmt: skip
        # loss sum, its count (samples, or pixels), skipped images, samples
        order.end_batch(rt.rank + j * rt.world_size,
                        torch.stack([loss_sum.double(), n.double(), n_bad.double(),
                                     (batch.size - n_bad).double()]))  # fmt: skip
        beat("val")
    if pad and batch is None:
        assert blank is not None, "a lockstep evaluation needs a blank batch for an empty shard"
        batch = blank()
    for _ in range(pad):
        with amp():
            task.idle_forward(model, batch)
    if watchdog is not None:
        watchdog.disarm()
    loss_sum, n, skipped, samples = order.join(rt.world_size).tolist()  # every rank
    computed = order.compute(metrics)
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
