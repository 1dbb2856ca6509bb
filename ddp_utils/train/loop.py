"""The training loop: train one epoch, step, validate, checkpoint, and ``fit`` around them."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_utils.checkpoint import diverged, finish_saves, resume, save
from ddp_utils.checkpoint.state import COUNT, LOSS_SUM, SKIPPED
from ddp_utils.config import TrainConfig
from ddp_utils.data import resolve_data
from ddp_utils.dist import (
    Runtime,
    agent_args,
    all_reduce_sum,
    barrier,
    restart_note,
    shared_store_warning,
)
from ddp_utils.evaluation import evaluate, scalars
from ddp_utils.lifecycle.preemption import Preempted
from ddp_utils.logs import log, setup_logging
from ddp_utils.run.folder import (
    classes_text,
    config_text,
    remove_if_unused,
    resolve_run_dir,
    resume_command,
    run_identity,
    seconds_since_process_start,
    write_on_main,
    write_run_files,
    write_run_record,
)
from ddp_utils.run.records import append_metrics, read_metrics
from ddp_utils.tasks import blank_batch, draw_predictions
from ddp_utils.tracking import TrackedRun, environment_text, peak_memory_mb
from ddp_utils.train.callbacks import Callback, build_callbacks
from ddp_utils.train.profiler import Profiler, batches
from ddp_utils.train.state import (
    Training,
    build_training,
    check_runtime,
    global_batch,
    resolve_auto,
)


def optimizer_step(tr: Training) -> None:
    with tr.phase("optimizer"):
        if tr.cfg.trainer.grad_clip is not None:
            tr.scaler.unscale_(tr.optimizer)
            tr.strategy.clip_grad_norm_(tr.cfg.trainer.grad_clip)
        tr.scaler.step(tr.optimizer)
        tr.scaler.update()
        tr.optimizer.zero_grad(set_to_none=True)
        tr.scheduler.step()
    tr.step += 1
    if tr.ema is not None:
        tr.strategy.update_ema(tr.ema, tr.step, in_warmup=tr.step <= tr.warmup_steps)


def train_step(tr: Training, images: Any, target: Any, scale: float) -> None:
    """Forward, loss, backward of one micro-batch; the loss is summed into ``epoch_totals``."""
    skip_bad = tr.data.skips_bad_images
    with tr.phase("data"):
        batch = tr.task.to_batch(images, target, tr.rt.device, tr.data.preprocess_train, skip_bad)
    if skip_bad:  # an unreadable image, skipped: counted apart, ignored
        tr.epoch_totals[SKIPPED] += batch.skipped
    # Padding duplicates are not real: the task sums over real samples only.
    with tr.phase("forward"), tr.amp():
        loss_sum, n_real = tr.task.train_loss(tr.model, batch)
    with tr.phase("backward"):
        tr.scaler.scale(loss_sum / n_real.clamp(min=1) * scale).backward()
    loss_sum = loss_sum.detach()
    if tr.scaler.is_enabled():
        # fp16: GradScaler skips the steps whose loss overflowed; they are not divergence,
        # so they stay out of the running loss (on the device: no host sync).
        finite = torch.isfinite(loss_sum)
        loss_sum, n_real = torch.where(finite, loss_sum, 0.0), torch.where(finite, n_real, 0)
    tr.epoch_totals[LOSS_SUM] += loss_sum
    tr.epoch_totals[COUNT] += n_real


def train_one_epoch(tr: Training) -> dict[str, float] | None:
    """Train the rest of the current epoch on this rank's shard (all of it unless resumed).

    Returns the epoch's loss averaged over every rank's samples; under
    ``trainer.val_every_steps`` it validates at those steps itself and returns None. Raises
    ``Preempted`` after checkpointing when a stop signal arrives.
    """
    loader, accum, sampler = tr.data.train, tr.cfg.trainer.grad_accum_steps, tr.data.train_sampler
    sampler.set_epoch(tr.epoch, tr.sample_offset)
    tr.callbacks.on_epoch_start(tr)
    tr.model.train()
    n_batches = len(loader)
    tr.progress.start_epoch(tr.epoch, tr.step, math.ceil(n_batches / accum))
    for i, (images, target) in enumerate(batches(loader, tr.phase)):
        group_start = i - i % accum
        group_len = min(accum, n_batches - group_start)
        last_micro = i == group_start + group_len - 1
        # Only the last micro-batch of a group all-reduces its gradients.
        with contextlib.nullcontext() if last_micro else tr.strategy.no_sync():
            train_step(tr, images, target, scale=1.0 / group_len)
        if last_micro:
            optimizer_step(tr)
            offset = sampler.consumed(i + 1, tr.cfg.data.batch_size)
            tr.samples_seen += sampler.trained_through(offset) - sampler.trained_through(
                tr.sample_offset
            )
            tr.sample_offset = offset
            end = i + 1 == n_batches
            due = validation_due(tr, end)
            after_step(tr, checkpoint_follows=due or (end and not step_mode(tr)))
            if due:
                validate_and_save(tr, interval_stats(tr), epoch_done=end)
                tr.model.train()
            if finished(tr):
                break
    tr.watchdog.disarm()
    tr.progress.end_epoch()
    if step_mode(tr):
        if tr.sample_offset == sampler.length:  # done, and no validation rolled it over
            tr.epoch, tr.sample_offset = tr.epoch + 1, 0
        return None
    return interval_stats(tr)


def step_mode(tr: Training) -> bool:
    """``trainer.val_every_steps``: validation and checkpoints at step counts, not epochs."""
    return tr.cfg.trainer.val_every_steps is not None


def finished(tr: Training) -> bool:
    """``trainer.max_steps`` steps (as many epochs as that takes), else ``trainer.epochs``;
    or a callback's ``stop_early`` (a pruned trial)."""
    return (
        tr.stop_early is not None
        or reached_max_steps(tr)
        or (tr.cfg.trainer.max_steps is None and tr.epoch >= tr.cfg.trainer.epochs)
    )


def validation_due(tr: Training, end_of_epoch: bool) -> bool:
    """Step mode: every ``val_every_steps`` steps and at the run's last step."""
    t = tr.cfg.trainer
    if t.val_every_steps is None:
        return False
    last_epoch = t.max_steps is None and end_of_epoch and tr.epoch + 1 >= t.epochs
    return tr.step % t.val_every_steps == 0 or reached_max_steps(tr) or last_epoch


def interval_stats(tr: Training) -> dict[str, float]:
    """The training loss and speed since the last validation (every rank): the epoch's, or
    in step mode the interval's.

    The loss is over every rank's samples (``epoch_totals`` also holds a resumed part, and
    counts pixels for masks); the speed counts the positions all ranks went through in this
    process (padding duplicates are no position of the epoch).
    """
    totals = all_reduce_sum(tr.epoch_totals.clone()).tolist()
    elapsed = time.perf_counter() - tr.interval_start
    samples = tr.samples_seen - tr.interval_samples
    stats = {
        "train/loss": totals[LOSS_SUM] / max(totals[COUNT], 1),
        "samples_per_s": samples / elapsed,
    }
    stats["mfu"] = tr.utilisation.of(stats["samples_per_s"])
    if tr.data.skips_bad_images:
        stats["train/skipped_images"] = int(totals[SKIPPED])
    return stats


def after_step(tr: Training, checkpoint_follows: bool) -> None:
    """Step-boundary duties: callbacks, a requested stop, step checkpoints (unless a
    validation's checkpoint follows at this step), the log line."""
    tr.watchdog.beat()
    if tr.step == tr.first_step:
        log.info("first training step done %.2f s after the process started",
                 seconds_since_process_start() or float("nan"))  # fmt: skip
    tr.callbacks.on_step_end(tr)
    every = tr.cfg.trainer.ckpt_every_steps
    step_checkpoint = bool(every) and tr.step % every == 0 and not checkpoint_follows
    # Before any checkpoint and at the run's end the ranks agree at once on a stop signal
    if tr.stop.poll(sync=checkpoint_follows or step_checkpoint or finished(tr)):
        if tr.stop.diverged:
            raise diverged(tr, "the training loss")
        with tr.phase("checkpoint"):
            save(tr, wait=True)  # written before the process leaves
        stopped = Preempted(tr.step, tr.stop.signum)
        if tr.rt.is_main:  # one line: every rank stops at this same step
            log.warning("%s: checkpoint written in run_dir=%s, exiting with code %d; relaunch the "
                        "same command to resume, or name the run: %s", stopped, tr.run_dir,
                        stopped.exit_code, resume_command(tr.run_dir))  # fmt: skip
        raise stopped
    if step_checkpoint:
        with tr.phase("checkpoint"):
            save(tr)
    tr.progress.update(tr.step)
    if tr.step % tr.cfg.trainer.log_every_steps == 0 and tr.rt.is_main:
        # This rank's running loss: one host sync per log point, none per step.
        loss_sum, count = tr.epoch_totals[[LOSS_SUM, COUNT]].tolist()
        loss, lr = loss_sum / max(count, 1), current_lr(tr)
        if not math.isfinite(loss):
            tr.stop.diverged = True  # every rank stops at the next poll, without saving
        tr.progress.report(tr.step, loss, lr)
        tr.trackers.log({"train/loss_running": loss, "lr": lr}, tr.step, running=True)


def current_lr(tr: Training) -> float:
    return tr.optimizer.param_groups[0]["lr"]


def reached_max_steps(tr: Training) -> bool:
    return tr.cfg.trainer.max_steps is not None and tr.step >= tr.cfg.trainer.max_steps


def validate(tr: Training, model: nn.Module, prefix: str) -> dict[str, Any]:
    """``prefix/NAME`` of every scalar metric (``accuracy``, ``loss``, ...) of ``model`` on the
    validation set; the full result (vectors too) goes to ``tr.validation[prefix]``."""
    val = evaluate(model, tr.data.val, tr.data.preprocess_eval, tr.rt, tr.task, tr.metrics,
                   tr.amp, tr.watchdog, skip_bad=tr.data.skips_bad_images,
                   lockstep=tr.strategy.lockstep_eval,
                   blank=lambda: blank_batch(tr.task, tr.cfg, tr.rt.device))  # fmt: skip
    tr.validation[prefix] = val
    numbers = scalars(val)
    if not tr.data.skips_bad_images:
        numbers.pop("skipped_images")
    return {f"{prefix}/{k}": v for k, v in numbers.items()}


def improved(value: float, best: float | None, mode: str) -> bool:
    """Whether ``value`` beats ``best`` (None: nothing yet) for ``task.monitor_mode``."""
    if best is None:
        return math.isfinite(value)
    return value > best if mode == "max" else value < best


def log_epoch(tr: Training, record: dict[str, Any]) -> None:
    """One line: the losses and the monitored metric (val/accuracy by default)."""
    key = tr.cfg.task.monitor
    shown = "" if key == "loss" else f" | val/{key} {record[f'val/{key}']:.4f}"
    if tr.ema is not None:
        shown += f" | val_ema/{key} {record[f'val_ema/{key}']:.4f}"
    rate = f"{record['samples_per_s']:.0f} samples/s"
    if "tokens_per_s" in record:
        rate = f"{record['tokens_per_s']:.0f} tokens/s, {record['tokens']} tokens"
    rate += f", mfu {100 * record['mfu']:.1f}%"
    log.info(
        "epoch %d | step %d | train/loss %.4f | val/loss %.4f%s (%d samples) | %s",
        tr.epoch, tr.step, record["train/loss"], record["val/loss"], shown,
        record["val/num_samples"], rate,
    )  # fmt: skip


def validate_and_save(
    tr: Training, train_stats: dict[str, float], epoch_done: bool = True
) -> dict[str, Any]:
    """Score the model on every rank (and the EMA weights), log it, then checkpoint: the start
    of the next epoch (``epoch_done``) or, in step mode, this step inside the epoch. The
    profiler's phases: ``validation`` for all but the checkpoint, ``checkpoint`` for it."""
    if not math.isfinite(train_stats["train/loss"]):  # all-reduced: the same on every rank
        raise diverged(tr, "the training loss")
    with tr.phase("validation"):
        record, also = score_and_log(tr, train_stats)
    if epoch_done:
        tr.epoch, tr.sample_offset = tr.epoch + 1, 0
    tr.epoch_totals.zero_()
    with tr.phase("checkpoint"):
        save(tr, also=tuple(also))
    with tr.phase("validation"):
        # After the checkpoint: a step a tracker has is one a resume does not train again.
        tr.trackers.log(record | {"peak_memory_mb": peak_memory_mb(tr.rt.device)}, tr.step)
        tr.callbacks.on_epoch_end(tr, record)
    tr.interval_start, tr.interval_samples = time.perf_counter(), tr.samples_seen
    return record


def score_and_log(tr: Training, train_stats: dict[str, float]) -> tuple[dict[str, Any], list]:
    """The validation record (metrics.jsonl's line and the log's), and the best checkpoints
    it makes (``best.pt``, ``best_ema.pt``)."""
    # Validate exactly what the checkpoint holds: rank 0's running statistics. (Training is
    # unchanged: rank 0's statistics follow their own course whatever the others hold.)
    scored = tr.strategy.eval_model
    tr.strategy.sync_buffers([scored] + ([tr.ema.module] if tr.ema is not None else []))
    record = {
        "epoch": tr.epoch, "step": tr.step, "world_size": tr.rt.world_size, "lr": current_lr(tr),
        **train_stats, **validate(tr, scored, "val"),
    }  # fmt: skip
    unit = tr.data.unit
    if unit.key is not None:  # token data: tokens seen and tokens per second
        record |= {unit.key: tr.samples_seen * unit.per_sample,
                   f"{unit.key}_per_s": train_stats["samples_per_s"] * unit.per_sample}  # fmt: skip
    if tr.ema is not None:
        record |= validate(tr, tr.ema.module, "val_ema")
    append_metrics(tr.run_dir, record, tr.rt)
    log_epoch(tr, record)
    also, key, mode = [], tr.cfg.task.monitor, tr.cfg.task.monitor_mode
    if improved(record[f"val/{key}"], tr.best, mode):
        tr.best = record[f"val/{key}"]
        also.append("best.pt")
    if tr.ema is not None and improved(record[f"val_ema/{key}"], tr.best_ema, mode):
        tr.best_ema = record[f"val_ema/{key}"]
        also += ["best_ema.pt"] if tr.cfg.trainer.save_best_ema else []
    return record, also


def fit(
    cfg: TrainConfig,
    rt: Runtime,
    default_run_dir: str | None = None,
    callbacks: Sequence[Callback] = (),
) -> float:
    """Train for ``trainer.epochs`` (or ``trainer.max_steps``); return the run's best
    ``val/<task.monitor>`` (a sweep's objective).

    Resumes from ``run_dir``'s newest checkpoint (``resume=auto``) or ``resume=PATH``.
    ``default_run_dir`` (a sweep job's folder) applies when ``run_dir`` is null; ``callbacks``
    join ``cfg.callbacks`` (the entry script's: a sweep's pruning).
    """
    check_runtime(cfg.trainer, rt)
    identity = run_identity(cfg)  # as composed: before anything is resolved for this machine
    cfg = resolve_auto(cfg, rt)
    cfg = dataclasses.replace(cfg, data=resolve_data(cfg.data, rt))
    run = resolve_run_dir(cfg.run_dir or default_run_dir, rt, identity, cfg.resume == "auto")
    tr: Training | None = None
    try:
        try:
            setup_logging(run.path, rt, "train")
            log.info(run.why)
            warning = shared_store_warning(os.environ, agent_args()) if rt.is_main else None
            if warning:
                log.warning(warning)
            extra = [*callbacks, *([Profiler(cfg.trainer.profiler)] if cfg.trainer.profile else [])]
            tr = build_training(cfg, rt, run.path, build_callbacks(cfg.callbacks, extra))
            try:
                train_epochs(tr)
                finish_saves(tr)  # the last save, which drawing and trackers overlapped
                if (run.path / "metrics.jsonl").exists():
                    # Every rank: a sharded model is gathered, for a task that draws only.
                    whole = tr.strategy.whole_model() if tr.task.draws else None
                    write_on_main(run.path, rt, lambda: draw_pictures(tr, whole))
                tr.trackers.finish(run_files(run.path))
                write_on_main(run.path, rt, lambda: write_run_record(run.path, identity, True))
            except BaseException:
                tr.close(drain=False)  # a rank may be gone: do not wait on it again
                raise
            tr.close()
            # Every rank has finished before any leaves the group: a rank that tore gloo down
            # while its peer still closed its helpers can abort the peer ("terminate called
            # without an active exception").
            barrier()
        except BaseException as e:
            if tr is None or tr.step < tr.first_step:  # no step taken: nothing to keep
                remove_if_unused(run, rt)
            elif rt.is_main and not isinstance(e, Preempted):  # Preempted's line says it
                then = restart_note() or ("relaunch the same command to resume, or name the "
                                          f"run: {resume_command(run.path)}")  # fmt: skip
                log.warning("the run stopped at step %d; run_dir=%s keeps its checkpoints: %s",
                            tr.step, run.path, then)  # fmt: skip
            raise
    finally:
        if run.lock is not None:
            run.lock.release()
    return float("nan") if tr.best is None else float(tr.best)


def run_files(run_dir: Path) -> list[Path]:
    """What the trackers keep of a finished run: its config, records and pictures."""
    named = [run_dir / n for n in ("config.yaml", "env.json", "metrics.jsonl", "eval.json")]
    return [p for p in [*named, *sorted(run_dir.glob("*.png"))] if p.is_file()]


def draw_pictures(tr: Training, model: nn.Module | None) -> None:
    """``curves.png`` and the task's predictions by the whole ``model``, once training is
    over (main rank)."""
    from ddp_utils.plot import plot_runs  # matplotlib: imported only when drawing

    plot_runs([tr.run_dir], tr.run_dir / "curves.png")
    if model is None:
        return
    draw_predictions(tr.task, model, tr.data.val.dataset, tr.data.preprocess_eval,
                     tr.rt, tr.data.classes, tr.run_dir)  # fmt: skip


def accumulation_note(cfg: TrainConfig, rt: Runtime) -> str:
    """What a global batch made by accumulation keeps and what it does not, and how to take it
    in one pass a process (docs/training-details.md)."""
    d, t = cfg.data, cfg.trainer
    per_step = d.global_batch_size // rt.world_size
    return (f"data.global_batch_size={d.global_batch_size} at world size {rt.world_size} is "
            f"{t.grad_accum_steps} accumulation steps of {d.batch_size} a process "
            f"(data.batch_size={d.batch_size}, the most a process takes): the optimisation of "
            f"{per_step} a process at optim.lr={cfg.optim.lr:g}, the learning rate set for this "
            f"global batch, with the same steps; BatchNorm and dropout see {d.batch_size} a "
            f"process. To take {per_step} a process in one pass, set data.batch_size={per_step} "
            "where memory allows, or launch more processes")  # fmt: skip


def train_epochs(tr: Training) -> None:
    """Resume if there is a checkpoint, then train the remaining epochs (or steps)."""
    cfg, rt, t = tr.cfg, tr.rt, tr.cfg.trainer
    resume(tr)
    tr.first_step = tr.step + 1
    files = {"config.yaml": lambda: config_text(cfg), "env.json": lambda: environment_text(rt)}
    if tr.data.classes is not None:
        files["classes.json"] = lambda: classes_text(tr.data.classes)
    write_run_files(tr.run_dir, files, rt)
    log.info(
        "run_dir %s | world size %d | device %s | backend %s | precision %s | global batch %d "
        "(%d per process x %d processes x %d accumulation steps) | %d steps",
        tr.run_dir, rt.world_size, rt.device, rt.backend, t.precision, global_batch(cfg, rt),
        cfg.data.batch_size, rt.world_size, t.grad_accum_steps, tr.total_steps,
    )  # fmt: skip
    if rt.is_main and cfg.data.global_batch_size and t.grad_accum_steps > 1:
        log.warning(accumulation_note(cfg, rt))
    tracked = TrackedRun(tr.run_dir, tr.run_dir.name, tr.config_record, tr.resumed_trackers)
    tr.trackers.start(tracked, read_metrics(tr.run_dir) if rt.is_main else [])
    if finished(tr):
        log.info("nothing to train: the run already did %d epochs, %d steps", tr.epoch, tr.step)
    tr.callbacks.on_train_start(tr)
    tr.stop.begin()
    tr.interval_start, tr.interval_samples = time.perf_counter(), tr.samples_seen
    while not finished(tr):
        stats = train_one_epoch(tr)
        if stats is not None:
            validate_and_save(tr, stats)
    tr.callbacks.on_train_end(tr)
