"""Optimizers and per-step learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from ddp_utils.config import OptimConfig, SchedConfig


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # Fused kernels on CUDA (one launch for all parameters), multi-tensor foreach elsewhere.
    on_cuda = bool(params) and params[0].is_cuda
    impl = {"fused": True} if on_cuda else {"foreach": True}
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
            **impl,
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, **impl
        )
    raise AssertionError(f"unvalidated optimizer {cfg.name}")


def lr_factor(
    cfg: SchedConfig, step: int, total_steps: int, steps_per_epoch: int, base_lr: float
) -> float:
    """Multiplier of the base lr after ``step`` optimizer steps (warmup, then the schedule)."""
    if step < cfg.warmup_steps:
        frac = step / cfg.warmup_steps
        return cfg.warmup_start_factor + (1.0 - cfg.warmup_start_factor) * frac
    if cfg.name == "cosine":
        floor = cfg.min_lr / base_lr
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.name == "step":
        return cfg.gamma ** (step // (cfg.step_epochs * steps_per_epoch))
    return 1.0


def build_scheduler(
    cfg: SchedConfig,
    optimizer: torch.optim.Optimizer,
    base_lr: float,
    total_steps: int,
    steps_per_epoch: int,
) -> LRScheduler:
    """A scheduler stepped once per optimizer step."""
    if cfg.name == "onecycle":
        return OneCycleLR(
            optimizer, max_lr=base_lr, total_steps=max(2, total_steps), pct_start=cfg.pct_start
        )

    def factor(step: int) -> float:
        return lr_factor(cfg, step, total_steps, steps_per_epoch, base_lr)

    return LambdaLR(optimizer, factor)
