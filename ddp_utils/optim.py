"""Optimizers (with the references' weight-decay groups) and per-step learning-rate schedules."""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ddp_utils.config import OptimConfig, SchedConfig

NORM_LAYERS = (
    nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm,
)  # fmt: skip


def param_groups(cfg: OptimConfig, model: nn.Module) -> list[dict]:
    """One group per weight decay: normalisation layers' parameters take
    ``optim.norm_weight_decay``, biases ``optim.bias_weight_decay`` (each null = the same as
    ``optim.weight_decay``), every other parameter ``optim.weight_decay``. With
    ``optim.decay_2d_only`` (GPT's rule) only parameters of 2 or more dimensions decay."""
    norm_wd = cfg.weight_decay if cfg.norm_weight_decay is None else cfg.norm_weight_decay
    bias_wd = cfg.weight_decay if cfg.bias_weight_decay is None else cfg.bias_weight_decay
    groups: dict[float, list[nn.Parameter]] = {}
    seen: set[int] = set()  # a shared parameter is optimised once
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if cfg.decay_2d_only:
                wd = cfg.weight_decay if p.ndim >= 2 else 0.0
            elif isinstance(module, NORM_LAYERS):
                wd = norm_wd
            elif name == "bias":
                wd = bias_wd
            else:
                wd = cfg.weight_decay
            groups.setdefault(wd, []).append(p)
    return [{"params": params, "weight_decay": wd} for wd, params in groups.items()]


def build_optimizer(
    cfg: OptimConfig, model: nn.Module, sharded: bool = False
) -> torch.optim.Optimizer:
    """The option's class (``optim._target_``) on the weight-decay groups, with the lr and
    the option's own arguments (``optimizer_kwargs``, for DTensor shards with ``sharded``)."""
    groups = param_groups(cfg, model)
    kwargs = cfg.optimizer_kwargs(sharded)
    return instantiate({"_target_": cfg._target_}, groups, lr=cfg.lr, **kwargs)


def warmup_steps(cfg: SchedConfig, steps_per_epoch: int) -> int:
    """``sched.warmup_steps``, or ``sched.warmup_epochs`` in optimizer steps."""
    return cfg.warmup(steps_per_epoch)


def lr_factor(
    cfg: SchedConfig, step: int, total_steps: int, steps_per_epoch: int, base_lr: float
) -> float:
    """Multiplier of the base lr after ``step`` optimizer steps (warmup, then the schedule)."""
    return cfg.lr_factor(step, total_steps, steps_per_epoch, base_lr)


def build_scheduler(
    cfg: SchedConfig,
    optimizer: torch.optim.Optimizer,
    base_lr: float,
    total_steps: int,
    steps_per_epoch: int,
) -> LRScheduler:
    """A scheduler stepped once per optimizer step: the option's own class where it names
    one (``sched._target_``), else its lr multiplier per step."""
    if cfg._target_:
        kwargs = cfg.scheduler_kwargs(base_lr, total_steps)
        return instantiate({"_target_": cfg._target_}, optimizer, **kwargs)

    def factor(step: int) -> float:
        return cfg.lr_factor(step, total_steps, steps_per_epoch, base_lr)

    return LambdaLR(optimizer, factor)
