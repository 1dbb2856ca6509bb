"""The training phases: build the DDP model, train one epoch, validate, checkpoint."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_utils.config import ConfigError, TrainConfig, TrainerConfig
from ddp_utils.data import BAD_LABEL, IGNORE_LABEL, DataBundle, build_data
from ddp_utils.dist import Runtime, all_reduce_sum
from ddp_utils.faults import SampleRecorder, maybe_inject
from ddp_utils.metrics import evaluate
from ddp_utils.models import build_model
from ddp_utils.optim import build_optimizer, build_scheduler
from ddp_utils.preemption import PREEMPTED_EXIT, Preempted, StopRequest
from ddp_utils.progress import Progress
from ddp_utils.resume import resume, save, seed_everything
from ddp_utils.run import (
    append_metrics,
    log,
    resolve_run_dir,
    seconds_since_process_start,
    setup_logging,
    write_classes,
    write_config,
)
from ddp_utils.tracking import Tracker, peak_memory_mb, write_environment
from ddp_utils.watchdog import StepWatchdog

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The per-epoch values of metrics.jsonl that also go to TensorBoard.
TRACKED = ("train/loss", "lr", "samples_per_s", "val/accuracy", "val/loss", "val/f1_macro")


def amp_context(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A factory of autocast contexts for ``precision`` (a no-op for full precision)."""
    if precision == "32":
        return contextlib.nullcontext
    dtype = AMP_DTYPES[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def check_runtime(cfg: TrainerConfig, rt: Runtime) -> None:
    """Refuse what this device cannot do before anything is written."""
    if cfg.sync_bn and rt.device.type != "cuda":
        raise ConfigError(
            "trainer.sync_bn=true needs CUDA: DDP refuses SyncBatchNorm on CPU modules. "
            "Set trainer.sync_bn=false on CPU (or use a model without BatchNorm)."
        )


def wrap_ddp(raw_model: nn.Module, cfg: TrainerConfig, rt: Runtime) -> nn.Module:
    """SyncBatchNorm if asked, DDP, and optionally torch.compile; returns the training module."""
    if cfg.sync_bn:
        raw_model = nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    raw_model.to(rt.device, memory_format=memory_format)
    model: nn.Module = DDP(
        raw_model,
        device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
    )
    if cfg.compile:
        model = torch.compile(model)
    return model


@dataclass
class Training:
    """Everything one run holds; ``raw_model`` is the unwrapped module inside ``model``."""

    cfg: TrainConfig
    rt: Runtime
    run_dir: Path
    raw_model: nn.Module
    model: nn.Module
    data: DataBundle
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    amp: Callable[[], AbstractContextManager]
    total_steps: int
    stop: StopRequest
    watchdog: StepWatchdog
    progress: Progress
    tracker: Tracker
    recorder: SampleRecorder
    # This rank's (loss sum, real samples, skipped images) of the epoch so far, on the device.
    epoch_totals: torch.Tensor
    epoch: int = 0  # epochs completed; the one in progress
    step: int = 0  # optimizer steps taken
    sample_offset: int = 0  # positions of this epoch's sample order already trained on
    best_accuracy: float = -1.0
    first_step: int = 1  # the step number of this process's first step (after a resume too)

    def close(self, drain: bool = True) -> None:
        """Stop the helpers: signal handlers, watchdog, progress bar, TensorBoard writer."""
        self.stop.close(drain)
        self.watchdog.close()
        self.progress.end_epoch()
        self.tracker.close()


def build_training(cfg: TrainConfig, rt: Runtime, run_dir: Path) -> Training:
    """Every rank: the model, data, optimizer and the helpers of one run (the stop request
    creates a process group, so all ranks must call this)."""
    t = cfg.trainer
    # The same seed on every rank for the weights (DDP also broadcasts rank 0's), then a
    # per-rank seed so augmentation and dropout differ between ranks.
    seed_everything(cfg.seed)
    raw_model = build_model(cfg.model, cfg.data)
    model = wrap_ddp(raw_model, t, rt)
    raw_model = model.module if isinstance(model, DDP) else model._orig_mod.module
    seed_everything(cfg.seed + rt.rank)
    data = build_data(cfg.data, rt, seed=cfg.seed, channels_last=t.channels_last)
    steps_per_epoch = math.ceil(len(data.train) / t.grad_accum_steps)
    total_steps = t.epochs * steps_per_epoch
    if t.max_steps is not None:
        total_steps = min(total_steps, t.max_steps)
    optimizer = build_optimizer(cfg.optim, raw_model)
    return Training(
        cfg=cfg,
        rt=rt,
        run_dir=run_dir,
        raw_model=raw_model,
        model=model,
        data=data,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg.sched, optimizer, cfg.optim.lr, total_steps, steps_per_epoch),
        scaler=torch.amp.GradScaler(rt.device.type, enabled=t.precision == "fp16"),
        amp=amp_context(t.precision, rt.device),
        total_steps=total_steps,
        stop=StopRequest(timedelta(seconds=t.timeout_s)),
        watchdog=StepWatchdog(t.timeout_s, rt.rank),
        progress=Progress(t.progress, rt.is_main, total_steps, global_batch(cfg, rt)),
        tracker=Tracker(cfg.logger, run_dir, rt),
        recorder=SampleRecorder(rt.rank),
        epoch_totals=torch.zeros(3, dtype=torch.float64, device=rt.device),
    )


def global_batch(cfg: TrainConfig, rt: Runtime) -> int:
    return cfg.data.batch_size * rt.world_size * cfg.trainer.grad_accum_steps


def optimizer_step(tr: Training) -> None:
    if tr.cfg.trainer.grad_clip is not None:
        tr.scaler.unscale_(tr.optimizer)
        nn.utils.clip_grad_norm_(tr.raw_model.parameters(), tr.cfg.trainer.grad_clip)
    tr.scaler.step(tr.optimizer)
    tr.scaler.update()
    tr.optimizer.zero_grad(set_to_none=True)
    tr.scheduler.step()
    tr.step += 1


def train_one_epoch(tr: Training) -> dict[str, float]:
    """Train the rest of the current epoch on this rank's shard (all of it unless resumed).

    Returns the epoch's loss averaged over every rank's samples. Raises ``Preempted`` after
    checkpointing when a stop signal arrives.
    """
    loader, accum, device = tr.data.train, tr.cfg.trainer.grad_accum_steps, tr.rt.device
    sampler, skip_bad = tr.data.train_sampler, tr.cfg.data.skip_bad_images
    sampler.set_epoch(tr.epoch, tr.sample_offset)
    if tr.recorder.path:
        tr.recorder.start_epoch(list(sampler))
    tr.model.train()
    n_batches, start = len(loader), time.perf_counter()
    tr.progress.start_epoch(tr.epoch, tr.step, math.ceil(n_batches / accum))
    for i, (images, labels) in enumerate(loader):
        group_start = i - i % accum
        group_len = min(accum, n_batches - group_start)
        last_micro = i == group_start + group_len - 1
        images = tr.data.preprocess_train(images.to(device, non_blocking=True))
        labels = labels.to(device, non_blocking=True)
        if skip_bad:  # an unreadable image, skipped: counted apart, its label ignored
            tr.epoch_totals[2] += (labels == BAD_LABEL).sum()
            labels = torch.where(labels == BAD_LABEL, IGNORE_LABEL, labels)
        # Only the last micro-batch of a group all-reduces its gradients.
        sync = contextlib.nullcontext() if last_micro else tr.model.no_sync()
        with sync:
            with tr.amp():
                loss_sum = F.cross_entropy(
                    tr.model(images).float(), labels, ignore_index=IGNORE_LABEL, reduction="sum"
                )
            # Padding duplicates carry an ignored label: the mean is over real samples only.
            n_real = (labels != IGNORE_LABEL).sum()
            tr.scaler.scale(loss_sum / n_real.clamp(min=1) / group_len).backward()
        tr.epoch_totals[0] += loss_sum.detach()
        tr.epoch_totals[1] += n_real
        tr.recorder.add_batch(i, tr.cfg.data.batch_size)
        if last_micro:
            optimizer_step(tr)
            tr.recorder.flush(tr.epoch, tr.step)
            tr.sample_offset = sampler.consumed(i + 1, tr.cfg.data.batch_size)
            after_step(tr, end_of_epoch=i + 1 == n_batches)
            if reached_max_steps(tr):
                break
    tr.watchdog.disarm()
    tr.progress.end_epoch()
    totals = all_reduce_sum(tr.epoch_totals.clone()).tolist()
    elapsed = time.perf_counter() - start
    stats = {"train/loss": totals[0] / max(totals[1], 1), "samples_per_s": totals[1] / elapsed}
    if skip_bad:
        stats["train/skipped_images"] = int(totals[2])
    return stats


def after_step(tr: Training, end_of_epoch: bool) -> None:
    """Step-boundary duties: a requested stop, step checkpoints, the log line."""
    tr.watchdog.beat()
    if tr.step == tr.first_step:
        log.info("first training step done %.2f s after the process started",
                 seconds_since_process_start() or float("nan"))  # fmt: skip
    maybe_inject(tr.step, tr.rt.rank)
    if tr.stop.poll():
        save(tr)
        stopped = Preempted(tr.step, tr.stop.signum)
        log.warning("%s: checkpoint written, exiting with code %d", stopped, PREEMPTED_EXIT)
        raise stopped
    every = tr.cfg.trainer.ckpt_every_steps
    if every and tr.step % every == 0 and not end_of_epoch:
        save(tr)
    tr.progress.update(tr.step)
    if tr.step % tr.cfg.trainer.log_every_steps == 0 and tr.rt.is_main:
        # This rank's running loss: one host sync per log point, none per step.
        loss_sum, count = tr.epoch_totals[:2].tolist()
        loss, lr = loss_sum / max(count, 1), current_lr(tr)
        tr.progress.report(tr.step, loss, lr)
        tr.tracker.scalars({"train/loss_running": loss, "lr": lr}, tr.step)


def current_lr(tr: Training) -> float:
    return tr.optimizer.param_groups[0]["lr"]


def reached_max_steps(tr: Training) -> bool:
    return tr.cfg.trainer.max_steps is not None and tr.step >= tr.cfg.trainer.max_steps


def validate_and_save(tr: Training, train_stats: dict[str, float]) -> dict[str, Any]:
    """Score the epoch on every rank, log it, then checkpoint the start of the next epoch."""
    val = evaluate(
        tr.raw_model, tr.data.val, tr.data.preprocess_eval, tr.rt, tr.cfg.data.num_classes, tr.amp
    )
    record = {
        "epoch": tr.epoch,
        "step": tr.step,
        "world_size": tr.rt.world_size,
        "lr": current_lr(tr),
        **train_stats,
        "val/accuracy": val["accuracy"],
        "val/loss": val["loss"],
        "val/f1_macro": val["f1_macro"],
        "val/num_samples": val["num_samples"],
    }
    if tr.cfg.data.skip_bad_images:
        record["val/skipped_images"] = val["skipped_images"]
    append_metrics(tr.run_dir, record, tr.rt)
    scalars = {key: record[key] for key in TRACKED if key in record}
    tr.tracker.scalars(scalars | {"peak_memory_mb": peak_memory_mb(tr.rt.device)}, tr.step)
    log.info(
        "epoch %d | step %d | train/loss %.4f | val/loss %.4f | val/accuracy %.4f (%d samples) "
        "| %.0f samples/s",
        tr.epoch, tr.step, record["train/loss"], val["loss"], val["accuracy"],
        val["num_samples"], record["samples_per_s"],
    )  # fmt: skip
    is_best = val["accuracy"] > tr.best_accuracy
    tr.best_accuracy = max(tr.best_accuracy, val["accuracy"])
    tr.epoch, tr.sample_offset = tr.epoch + 1, 0
    tr.epoch_totals.zero_()
    save(tr, is_best=is_best)
    return record


def fit(cfg: TrainConfig, rt: Runtime, default_run_dir: str | None = None) -> float:
    """Train for ``trainer.epochs`` (or ``trainer.max_steps``); return the last val accuracy.

    Resumes from ``run_dir``'s newest checkpoint (``resume=auto``) or ``resume=PATH``.
    ``default_run_dir`` (a sweep job's folder) applies when ``run_dir`` is null.
    """
    check_runtime(cfg.trainer, rt)
    run_dir = resolve_run_dir(cfg.run_dir or default_run_dir, rt)
    setup_logging(run_dir, rt, "train")
    tr = build_training(cfg, rt, run_dir)
    try:
        record = train_epochs(tr)
    except BaseException:
        tr.close(drain=False)  # a rank may be gone: do not wait on it again
        raise
    tr.close()
    if rt.is_main and (run_dir / "metrics.jsonl").exists():
        from ddp_utils.plot import plot_runs  # matplotlib: imported only when drawing

        plot_runs([run_dir], run_dir / "curves.png")
    return float(record.get("val/accuracy", float("nan")))


def train_epochs(tr: Training) -> dict[str, Any]:
    """Resume if there is a checkpoint, then train the remaining epochs; the last record."""
    cfg, rt, t = tr.cfg, tr.rt, tr.cfg.trainer
    resume(tr)
    tr.first_step = tr.step + 1
    write_config(tr.run_dir, cfg, rt)
    write_environment(tr.run_dir, rt)
    write_classes(tr.run_dir, tr.data.classes, rt)
    log.info(
        "run_dir %s | world size %d | device %s | backend %s | global batch %d "
        "(%d per process x %d processes x %d accumulation steps) | %d steps",
        tr.run_dir, rt.world_size, rt.device, rt.backend, global_batch(cfg, rt),
        cfg.data.batch_size, rt.world_size, t.grad_accum_steps, tr.total_steps,
    )  # fmt: skip
    if tr.epoch >= t.epochs or reached_max_steps(tr):
        log.info("nothing to train: the run already did %d epochs, %d steps", tr.epoch, tr.step)
    record: dict[str, Any] = {}
    while tr.epoch < t.epochs and not reached_max_steps(tr):
        record = validate_and_save(tr, train_one_epoch(tr))
    return record
