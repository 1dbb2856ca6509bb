"""Saving and restoring the full training state, so that a restart loses nothing."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ddp_utils.checkpoint import (
    load_checkpoint,
    newest_loadable,
    step_checkpoints,
)
from ddp_utils.config import ConfigError, TrainConfig, as_plain_dict, option_defaults
from ddp_utils.data.classes import class_difference
from ddp_utils.dist import Runtime, all_reduce_sum, broadcast_object
from ddp_utils.optim import build_scheduler
from ddp_utils.run import log
from ddp_utils.train.finite import check_state
from ddp_utils.train.rng import capture_rng, restore_rng, seed_everything

if TYPE_CHECKING:
    from ddp_utils.train.state import Training


def identity_keys(cfg: TrainConfig) -> tuple[str, ...]:
    """Keys whose change makes a checkpoint belong to another experiment: the model (all of
    it), what the data and task options declare (``identity``: the data set, its split, the
    objective), and the seed (it decides every epoch's sample order, which a mid-epoch resume
    continues)."""
    return ("seed", "model.", *(f"data.{k}" for k in type(cfg.data).identity),
            *(f"task.{k}" for k in type(cfg.task).identity))  # fmt: skip


SCHEDULE_LENGTH_KEYS = ("total_steps", "_schedule_phases")  # OneCycleLR's


def checkpoint_state(tr: Training) -> dict[str, Any]:
    """The whole training state; every rank must call it (it gathers each rank's RNG state).

    Plain tensors and containers only, so ``torch.load(weights_only=True)`` reads it.
    """
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


def save(tr: Training, also: tuple[str, ...] = ()) -> None:
    """Checkpoint from every rank's state; the main rank writes it (and publishes it as each
    name in ``also``, such as best.pt), everyone waits for it."""
    state = checkpoint_state(tr)
    check_state(tr, state["epoch_totals"][0])  # nothing non-finite is ever written
    ckpt_dir = tr.run_dir / "checkpoints"
    path = tr.strategy.save(state, ckpt_dir, also, tr.cfg.trainer.keep_last)
    tr.callbacks.on_checkpoint(tr, path)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _is_identity(key: str, identity: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k if k.endswith(".") else f"{k}.") for k in identity)


def config_changes(stored: dict[str, Any], cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """(refused, allowed) changes between a checkpoint's config and this run's, as 'key: a -> b'.

    A key the checkpoint's release did not have yet (``task.*`` before tasks existed) counts
    as its default then: what that release did. A key this run's option has no longer (older
    releases stored every data option's keys) is not compared."""
    plain = as_plain_dict(cfg)
    new = _flatten(plain)
    base = as_plain_dict(TrainConfig())  # a group the checkpoint lacks had its default option
    record = {g: stored.get(g, base[g]) for g in base} | stored
    old = _flatten(as_plain_dict(option_defaults(cfg))) | _flatten(record)
    old = {k: v for k, v in old.items() if _field_of(k, plain)}
    refused, allowed, identity = [], [], identity_keys(cfg)
    for key in sorted(old.keys() | new.keys()):
        if key == "resume" or old.get(key) == new.get(key):
            continue
        change = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        is_identity = _is_identity(key, identity)
        (refused if is_identity else allowed).append(change)
    return refused, allowed


def _field_of(key: str, cfg: dict[str, Any]) -> bool:
    """Whether ``key``'s group and field (``data.kwargs`` of ``data.kwargs.limit``) are in
    ``cfg``."""
    node: Any = cfg
    for part in key.split(".")[:2]:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def pick_checkpoint(resume_from: str, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint ``resume`` names, loaded, or None to start fresh (main rank)."""
    ckpt_dir = run_dir / "checkpoints"
    if resume_from == "never":
        if step_checkpoints(ckpt_dir) or (ckpt_dir / "last.pt").exists():
            raise ConfigError(
                f"resume=never but run_dir={run_dir} already holds checkpoints. Continue it "
                "with resume=auto, or start fresh with another run_dir=PATH."
            )
        return None
    if resume_from == "auto":
        return newest_loadable(ckpt_dir, log.warning)
    return Path(resume_from), load_checkpoint(resume_from)


def resume(tr: Training) -> None:
    """Restore ``tr`` from the checkpoint that ``resume`` names, if any (same on every rank).

    The main rank chooses (and loads) it; the others learn the path, or the error, from it.
    """
    picked, error = None, None
    if tr.rt.is_main:
        try:
            picked = pick_checkpoint(tr.cfg.resume, tr.run_dir)
        except ConfigError as e:
            error = str(e)
    path, error = broadcast_object((picked[0] if picked else None, error))
    if error:
        raise ConfigError(error)
    if path is None:
        set_aside_metrics(tr.run_dir / "metrics.jsonl", tr.rt)
        return
    ckpt = picked[1] if picked else load_checkpoint(path)
    refused, allowed = config_changes(ckpt["config"], tr.cfg)
    if refused:
        raise ConfigError(
            f"cannot resume from {path}: this run changes the model, data set or seed:\n  "
            + "\n  ".join(refused)
            + "\nResume with the checkpoint's settings, or start a new run (another run_dir)."
        )
    stored_classes = ckpt.get("classes")
    if (
        stored_classes is not None
        and tr.data.classes is not None
        and stored_classes != tr.data.classes
    ):
        diff = class_difference(stored_classes, tr.data.classes, "the checkpoint", "the data")
        raise ConfigError(
            f"cannot resume from {path}: its classes differ from the data's now ({diff}). "
            "Restore the class folders, or start a new run (another run_dir)."
        )
    if allowed:
        log.info("resuming with changed settings: %s", "; ".join(allowed))
    restore(tr, ckpt)
    trim_metrics(tr.run_dir / "metrics.jsonl", tr.step, tr.rt)
    log.info(
        "resumed from %s: epoch %d, step %d, %d samples into the epoch (saved at world size %d)",
        path, tr.epoch, tr.step, tr.sample_offset, ckpt["world_size"],
    )  # fmt: skip


def resumed_total_steps(tr: Training, ckpt: dict[str, Any]) -> tuple[int, int]:
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


def restore(tr: Training, ckpt: dict[str, Any]) -> None:
    if "converted_from" in ckpt:
        raise ConfigError(
            f"this checkpoint was converted from {ckpt['converted_from']} for evaluation and "
            "holds no optimizer state: resume from that folder."
        )
    states = tr.strategy.read_states(ckpt, tr.optimizer, tr.ema)
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


def set_aside_metrics(path: Path, rt: Runtime) -> None:
    """A fresh start in a run_dir that holds records but no checkpoint (killed before its
    first one, or its checkpoints deleted): keep the old records under another name, so the
    new run never logs an epoch a second time in metrics.jsonl."""
    if rt.is_main and path.exists() and path.stat().st_size > 0:
        old = path.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl.old")
        path.rename(old)
        log.warning("no checkpoint to continue: the earlier metrics.jsonl is now %s", old.name)


def trim_metrics(path: Path, step: int, rt: Runtime) -> None:
    """Drop records logged after the checkpoint, which the resumed run will log again."""
    if not rt.is_main or not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        path.write_text("".join(line + "\n" for line in kept))
