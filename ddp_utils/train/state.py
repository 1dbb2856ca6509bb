"""The state of one training run (``Training``) and how every rank builds it."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchmetrics import MetricCollection

from ddp_utils.checkpoint.save import Checkpointer
from ddp_utils.config import ConfigError, TrainConfig, TrainerConfig, as_plain_dict
from ddp_utils.data import DataBundle, build_data
from ddp_utils.dist import Runtime, side_group_timeout
from ddp_utils.evaluation import build_metrics
from ddp_utils.flops import Utilisation, peak_flops, training_flops_per_sample
from ddp_utils.lifecycle.preemption import StopRequest
from ddp_utils.lifecycle.watchdog import StepWatchdog
from ddp_utils.logs import log
from ddp_utils.models import build_model
from ddp_utils.models.ema import EMA, ema_decay
from ddp_utils.optim import build_optimizer, build_scheduler, warmup_steps
from ddp_utils.progress import Progress
from ddp_utils.rng import seed_everything
from ddp_utils.strategy import Strategy, build_strategy, strategy_class
from ddp_utils.tasks import Task, build_task, check_task
from ddp_utils.tracking import Trackers, build_trackers, reset_peak_memory
from ddp_utils.train.precision import amp_context, resolve_precision, set_numerics

_NO_PHASE = contextlib.nullcontext()


def no_phase(name: str) -> AbstractContextManager:
    """The loop's phase mark when nothing profiles: one shared no-op (the profiler's
    callback puts torch.profiler's in its place while it records)."""
    return _NO_PHASE


def check_runtime(cfg: TrainerConfig, rt: Runtime) -> None:
    """Refuse what this device cannot do before anything is written."""
    strategy_class(cfg).check(cfg, rt)  # a strategy that does not exist, or cannot run here
    if cfg.ddp.sync_bn and rt.device.type != "cuda":
        raise ConfigError(
            "trainer.ddp.sync_bn=true needs CUDA: DDP refuses SyncBatchNorm on CPU modules. "
            "Set trainer.ddp.sync_bn=false on CPU (or use a model without BatchNorm)."
        )


def resolve_auto(cfg: TrainConfig, rt: Runtime) -> TrainConfig:
    """The config with ``trainer.precision=auto`` replaced by what this device runs, and a
    ``data.global_batch_size`` split into this world size's per-process batch and
    accumulation steps, so the log, config.yaml and checkpoints say what was chosen."""
    t = cfg.trainer
    precision = resolve_precision(t.precision, rt.device, cfg.model)
    channels_last = t.channels_last
    if channels_last == "auto":
        channels_last = "true" if rt.device.type == "cuda" else "false"
    trainer = dataclasses.replace(t, precision=precision, channels_last=channels_last)
    data = cfg.data
    if data.global_batch_size is not None:
        if t.grad_accum_steps != 1:
            raise ConfigError(
                f"data.global_batch_size={data.global_batch_size} sets the accumulation steps "
                f"itself: drop trainer.grad_accum_steps={t.grad_accum_steps}, or drop "
                "data.global_batch_size and set data.batch_size."
            )
        batch, accum = split_global_batch(data.global_batch_size, rt.world_size, data.batch_size)
        data = dataclasses.replace(data, batch_size=batch)
        trainer = dataclasses.replace(trainer, grad_accum_steps=accum)
    return dataclasses.replace(cfg, trainer=trainer, data=data)


def split_global_batch(global_batch: int, world_size: int, cap: int) -> tuple[int, int]:
    """(per-process batch, accumulation steps) that make ``global_batch`` at ``world_size``:
    the fewest accumulation steps whose per-process batch is at most ``cap`` (one always
    exists when the world size divides the global batch)."""
    for accum in range(1, global_batch // world_size + 1):
        batch, rest = divmod(global_batch, world_size * accum)
        if rest == 0 and batch <= cap:
            return batch, accum
    below = global_batch // world_size * world_size
    nearest = " or ".join(str(n) for n in (below, below + world_size) if n > 0)
    raise ConfigError(
        f"data.global_batch_size={global_batch} cannot be split over {world_size} processes: "
        f"it must be a multiple of the world size (each process takes an equal share). Set "
        f"data.global_batch_size={nearest}, or launch a world size that divides it."
    )


@dataclass
class Training:
    """Everything one run holds; ``raw_model`` is the unwrapped module inside ``model``."""

    cfg: TrainConfig
    config_record: dict[str, Any]  # cfg as stored in every checkpoint, converted once
    rt: Runtime
    run_dir: Path
    strategy: Strategy  # how the model is distributed; it holds the model
    data: DataBundle
    task: Task
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    warmup_steps: int
    scaler: torch.amp.GradScaler
    amp: Callable[[], AbstractContextManager]
    ema: EMA | None
    total_steps: int
    stop: StopRequest
    watchdog: StepWatchdog
    progress: Progress
    trackers: Trackers  # the main rank's; started after the resume
    # A ddp_utils.train.callbacks.CallbackList (that module's hooks take a Training, so this
    # one does not import it back).
    callbacks: Any
    checkpointer: Checkpointer  # where saves go, and the one in flight
    metrics: MetricCollection  # validation's, reset for each model scored
    # This rank's (loss sum, its count, skipped images) of the epoch so far, on the device;
    # the count is the samples' (classification) or the counted pixels' (segmentation).
    epoch_totals: torch.Tensor
    utilisation: Utilisation  # the model's FLOPs and the device's peak, for `mfu`
    # The loop's phase marks (data, forward, backward, optimizer): torch.profiler's
    # record_function while trainer.profile records, else one shared no-op.
    phase: Callable[[str], AbstractContextManager] = no_phase
    epoch: int = 0  # epochs completed; the one in progress
    step: int = 0  # optimizer steps taken
    sample_offset: int = 0  # positions of this epoch's sample order already trained on
    # The best val/<task.monitor> (val_ema/<task.monitor>) so far; None before the first.
    best: float | None = None
    best_ema: float | None = None
    first_step: int = 1  # the step number of this process's first step (after a resume too)
    samples_seen: int = 0  # the positions all ranks trained on so far (tokens: x block_size)
    # Step mode's interval since the last validation: its start time and samples_seen then
    interval_start: float = 0.0
    interval_samples: int = 0
    # Set by a callback (Optuna's pruning) to end the run after this validation, cleanly.
    stop_early: str | None = None
    resumed_trackers: dict[str, Any] = field(default_factory=dict)  # the checkpoint's ids
    # The last validation's full results by prefix ("val", "val_ema"): the confusion matrix,
    # per-class accuracy, ... of which metrics.jsonl keeps the headline numbers.
    validation: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def model(self) -> nn.Module:
        """What the training forward runs (wrapped by the strategy)."""
        return self.strategy.model

    @property
    def raw_model(self) -> nn.Module:
        """The unwrapped module: what checkpoints, EMA and predictions know."""
        return self.strategy.raw_model

    def close(self, drain: bool = True) -> None:
        """Stop the helpers: signal handlers, watchdog, progress bar, the trackers, the
        loaders' workers; without ``drain`` (a failed run) wait for a whole file's save in
        flight, which needs no other rank."""
        if not drain:
            self.checkpointer.close(drain=False)
        self.stop.close(drain)
        self.watchdog.close()
        self.progress.end_epoch()
        self.trackers.close()
        self.data.close()


def check_batch_sizes(raw_model: nn.Module, sampler: Any, batch_size: int, rt: Runtime) -> None:
    """A model with BatchNorm never gets a training batch of one: BatchNorm in training mode
    raises on it ("Expected more than 1 value per channel") and the epoch is lost."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in raw_model.modules()):
        return
    per_rank = sampler.shard_length(0)
    if batch_size == 1 or per_rank % batch_size == 1:
        why = ("data.batch_size=1" if batch_size == 1 else
               f"with data.drop_last=false each rank's last batch of an epoch holds one sample "
               f"({per_rank} samples a rank at world size {rt.world_size}, in batches of "
               f"{batch_size})")  # fmt: skip
        raise ConfigError(
            f"{why}, and the model has BatchNorm, which cannot train on a batch of one. Set "
            "data.drop_last=true (the default) and data.batch_size of 2 or more."
        )


def global_batch(cfg: TrainConfig, rt: Runtime) -> int:
    return cfg.data.batch_size * rt.world_size * cfg.trainer.grad_accum_steps


def build_ema(cfg: TrainConfig, rt: Runtime, strategy: Strategy) -> EMA | None:
    t = cfg.trainer
    if t.ema_decay is None:
        return None
    decay = ema_decay(t.ema_decay, t.ema_every_steps, global_batch(cfg, rt), t.epochs)
    return strategy.make_ema(decay, t.ema_every_steps)


def build_training(cfg: TrainConfig, rt: Runtime, run_dir: Path, callbacks: Any) -> Training:
    """Every rank: the model, data, optimizer and the helpers of one run (the stop request
    creates a process group, so all ranks must call this). ``cfg`` has a resolved precision."""
    t = cfg.trainer
    task = build_task(cfg)
    peak = prepare_device(t, rt, task)
    # The same seed on every rank for the weights (DDP also broadcasts rank 0's), then a
    # per-rank seed so augmentation and dropout differ between ranks.
    seed_everything(cfg.seed)
    strategy = build_strategy(t, rt)
    strategy.wrap(strategy.build(lambda: build_model(cfg.model, cfg.data, task.num_outputs())))
    raw_model = strategy.raw_model
    metrics = build_metrics(cfg.task, task, rt.device)
    forward_flops = check_task(task, raw_model, metrics, cfg, rt.device,
                               amp_context(t.precision, rt.device))  # fmt: skip
    usage = utilisation(raw_model, forward_flops, peak, rt)
    seed_everything(cfg.seed + rt.rank)
    data = build_data(cfg.data, rt, seed=cfg.seed, channels_last=t.channels_last)
    check_batch_sizes(raw_model, data.train_sampler, cfg.data.batch_size, rt)
    steps_per_epoch = math.ceil(len(data.train) / t.grad_accum_steps)
    total_steps = t.epochs * steps_per_epoch if t.max_steps is None else t.max_steps
    optimizer = build_optimizer(cfg.optim, raw_model, sharded=strategy.shards_parameters)
    return Training(
        cfg=cfg,
        config_record=as_plain_dict(cfg),
        rt=rt,
        run_dir=run_dir,
        strategy=strategy,
        data=data,
        task=task,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg.sched, optimizer, cfg.optim.lr, total_steps, steps_per_epoch),
        warmup_steps=warmup_steps(cfg.sched, steps_per_epoch),
        scaler=strategy.make_scaler(enabled=t.precision == "fp16"),
        amp=amp_context(t.precision, rt.device),
        ema=build_ema(cfg, rt, strategy),
        total_steps=total_steps,
        stop=StopRequest(side_group_timeout(t), t.stop_poll_s),
        watchdog=StepWatchdog(t.timeout_s, rt.rank),
        progress=Progress(
            t.progress,
            rt.is_main,
            total_steps,
            global_batch(cfg, rt) * data.unit.per_sample,
            unit=data.unit.short,
            mfu_of=lambda per_s: usage.of(per_s / data.unit.per_sample),
        ),  # fmt: skip
        trackers=build_trackers(cfg.logger, cfg.logger_cfg, rt),
        callbacks=callbacks,
        checkpointer=Checkpointer(t.checkpoint, run_dir, rt, t.keep_last),
        metrics=metrics,
        epoch_totals=torch.zeros(3, dtype=torch.float64, device=rt.device),
        utilisation=usage,
    )


def prepare_device(t: TrainerConfig, rt: Runtime, task: Task) -> tuple[float, str]:
    """The device's switches before the model is built (TF32 and cuDNN's autotuning on CUDA,
    as the task's inputs allow; determinism), its peak-memory counter, and its peak FLOP/s in
    the run's precision (with the source of that number), which ``mfu`` divides by. It asks the
    device nothing that needs a tensor on it, so that its CUDA branch runs on a CPU with the
    probe faked."""
    flags = set_numerics(t, rt.device, task.fixed_input_shapes)
    if t.deterministic and rt.device.type == "cuda" and task.nondeterministic_on_cuda:
        log.warning("trainer.deterministic=true: %s has no deterministic CUDA kernel; torch "
                    "warns when it runs, and two runs can differ in the last bits",
                    task.nondeterministic_on_cuda)  # fmt: skip
    reset_peak_memory(rt.device)
    return peak_flops(rt.device, t.precision, t.peak_flops, flags.tf32)


def utilisation(
    model: nn.Module, forward_flops: float, peak: tuple[float, str], rt: Runtime
) -> Utilisation:
    """The model's training FLOPs a sample and the device's peak: what ``mfu`` divides."""
    usage = Utilisation(training_flops_per_sample(model, forward_flops), *peak,
                        rt.world_size)  # fmt: skip
    log.info("model FLOPs: %s", usage.describe())
    return usage
