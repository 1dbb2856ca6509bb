"""What a checkpoint holds of a run, and how a run is put back from it: ``capture`` (every
rank; it gathers each rank's RNG state) and ``restore``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddp_utils.checkpoint.format import read_states
from ddp_utils.config import ConfigError, TrainConfig
from ddp_utils.dist import Runtime, all_reduce_sum
from ddp_utils.logs import log
from ddp_utils.optim import build_scheduler
from ddp_utils.rng import capture_rng, restore_rng, seed_everything

SCHEDULE_LENGTH_KEYS = ("total_steps", "_schedule_phases")  # OneCycleLR's
# The epoch's running sums (``epoch_totals``, one float64 tensor so that one all-reduce sums
# them all): the loss, its count (samples, or counted pixels), the skipped images.
LOSS_SUM, COUNT, SKIPPED = 0, 1, 2


class TrainingState(Protocol):
    """What a checkpoint reads and restores of a run: ``ddp_utils.train.state.Training``
    (declared here so that the checkpoint does not import the training loop's floor)."""

    rt: Runtime
    cfg: TrainConfig
    run_dir: Path
    strategy: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    ema: Any
    data: Any
    trackers: Any
    callbacks: Any
    checkpointer: Any  # ddp_utils.checkpoint.save.Checkpointer
    progress: Any
    raw_model: torch.nn.Module
    config_record: dict[str, Any]
    epoch: int
    step: int
    sample_offset: int
    epoch_totals: torch.Tensor
    best: float | None
    best_ema: float | None
    samples_seen: int
    total_steps: int
    resumed_trackers: dict[str, Any]


def capture(tr: TrainingState) -> dict[str, Any]:
    """The whole training state; every rank must call it (it gathers each rank's RNG state).

    Plain tensors and containers only, so ``torch.load(weights_only=True)`` reads it.
    """
    # Rank 0's running statistics, on every rank: a sharded checkpoint keeps one rank's copy
    # of a buffer, and a resume must find the very ones the uninterrupted run goes on with.
    tr.strategy.sync_buffers([tr.raw_model, *([tr.ema.module] if tr.ema is not None else [])])
    rng = [None] * tr.rt.world_size
    dist.all_gather_object(rng, capture_rng(tr.rt.device))
    epoch_totals = all_reduce_sum(tr.epoch_totals.clone()).cpu()
    return {
        "model": tr.strategy.model_state_dict(),
        "optimizer": tr.strategy.optimizer_state_dict(tr.optimizer),
        "strategy": tr.strategy.state_dict(),
        "scheduler": tr.scheduler.state_dict(),
        "scaler": tr.scaler.state_dict(),
        "epoch": tr.epoch,
        "step": tr.step,
        "sample_offset": tr.sample_offset,
        "epoch_totals": epoch_totals,
        "sampler": {"seed": tr.cfg.seed, "epoch": tr.epoch, "start": tr.sample_offset},
        "rng": rng,
        "best": tr.best,
        "best_ema": tr.best_ema,
        **({"model_ema": tr.ema.state_dict()} if tr.ema else {}),
        "world_size": tr.rt.world_size,
        "classes": tr.data.classes,
        "samples_seen": tr.samples_seen,
        "trackers": tr.trackers.state(),  # the tracker runs a resume continues (main rank's)
        **tr.data.checkpoint_extras,  # what inference needs of the data (a tokenizer)
        "config": tr.config_record,
    }


def restore(tr: TrainingState, ckpt: dict[str, Any]) -> None:
    if "converted_from" in ckpt:
        raise ConfigError(
            f"this checkpoint was converted from {ckpt['converted_from']} for evaluation and "
            "holds no optimizer state: resume from that folder."
        )
    states = read_states(ckpt, lambda: templates(tr), tr.strategy.shards_parameters)
    tr.strategy.load_model_state_dict(states["model"])
    total, per_epoch = resumed_total_steps(tr, ckpt)
    if total != tr.total_steps:
        # Another world size re-shards the rest of the epoch into another number of steps:
        # the schedule is rebuilt for the length this run will really have.
        log.info("the run's length from here: %d optimizer steps in all, %d done at world "
                 "size %d and %d to go at world size %d (%d an epoch), where this command "
                 "started afresh would take %d; the learning-rate schedule is rebuilt for %d",
                 total, ckpt["step"], ckpt["world_size"], total - ckpt["step"],
                 tr.rt.world_size, per_epoch, tr.total_steps, total)  # fmt: skip
        tr.total_steps = tr.progress.total_steps = total
        tr.scheduler = build_scheduler(
            tr.cfg.sched, tr.optimizer, tr.cfg.optim.lr, total, per_epoch
        )
    tr.strategy.load_optimizer_state_dict(tr.optimizer, states["optimizer"])
    tr.strategy.load_state_dict(ckpt.get("strategy") or {}, ckpt["world_size"])
    # The schedule's length follows this run's config (trainer.epochs may have grown): keep
    # the freshly built scheduler's length, take the rest (its position) from the checkpoint.
    length = {k: v for k, v in tr.scheduler.state_dict().items() if k in SCHEDULE_LENGTH_KEYS}
    tr.scheduler.load_state_dict(ckpt["scheduler"] | length)
    tr.scaler.load_state_dict(ckpt["scaler"])
    tr.epoch, tr.step = ckpt["epoch"], ckpt["step"]
    tr.sample_offset = ckpt["sample_offset"]
    tr.samples_seen = ckpt.get("samples_seen", 0)  # 0: a checkpoint from before it was kept
    tr.resumed_trackers = ckpt.get("trackers") or {}
    tr.best, tr.best_ema = resumed_best(ckpt, tr.cfg.task.monitor)
    if tr.ema is not None and "model_ema" in states:
        tr.ema.load_state_dict(states["model_ema"])
    # The epoch's running loss continues from the saved global totals, held by one rank.
    tr.epoch_totals.zero_()
    if tr.rt.is_main:
        tr.epoch_totals += ckpt["epoch_totals"].to(tr.epoch_totals)
    if ckpt["world_size"] == tr.rt.world_size:
        restore_rng(ckpt["rng"][tr.rt.rank], tr.rt.device)
    else:
        # Another world size: no rank's stream carries over; derive fresh, distinct ones.
        seed_everything(tr.cfg.seed + 1_000_003 * (tr.step + 1) + tr.rt.rank)


def resumed_total_steps(tr: TrainingState, ckpt: dict[str, Any]) -> tuple[int, int]:
    """(the run's length in optimizer steps, steps per epoch) from the checkpoint on, at this
    world size: its steps so far, the rest of its epoch, then whole epochs (or
    trainer.max_steps)."""
    t, batch, sampler = tr.cfg.trainer, tr.cfg.data.batch_size, tr.data.train_sampler

    def steps(start: int) -> int:
        per_rank = sampler.shard_length(start)
        return math.ceil(math.ceil(per_rank / batch) / t.grad_accum_steps)

    if t.max_steps is not None:  # the run's length, whatever the world size
        return t.max_steps, steps(0)
    rest = steps(ckpt["sample_offset"]) if ckpt["epoch"] < t.epochs else 0
    total = ckpt["step"] + rest + max(0, t.epochs - ckpt["epoch"] - 1) * steps(0)
    return total, steps(0)


def resumed_best(ckpt: dict[str, Any], monitor: str) -> tuple[float | None, float | None]:
    """The best monitored values so far. A checkpoint from before ``task.monitor`` existed
    kept the best accuracy (-1 for none yet); a changed monitor starts its best afresh."""
    stored = ckpt.get("config", {}).get("task", {}).get("monitor", "accuracy")
    if stored != monitor:
        return None, None
    if "best" in ckpt:
        return ckpt["best"], ckpt.get("best_ema")
    old = [ckpt.get("best_accuracy", -1.0), ckpt.get("best_ema_accuracy", -1.0)]
    best, best_ema = (None if v is None or v < 0 else v for v in old)
    return best, best_ema


def templates(tr: TrainingState) -> dict[str, Any]:
    """This run's own state dicts (its shards, under a sharding strategy), which a sharded
    checkpoint is read into."""
    own = {"model": tr.strategy.model_state_dict(),
           "optimizer": tr.strategy.optimizer_state_dict(tr.optimizer)}  # fmt: skip
    return own | ({"model_ema": tr.ema.state_dict()} if tr.ema is not None else {})
