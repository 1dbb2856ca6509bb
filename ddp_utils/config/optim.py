"""The ``optim`` and ``sched`` groups' schemas: the keys every option has, then each
option's own, and what each option builds.

An optimizer option names its class (``_target_``) and the keyword arguments it adds
(``optimizer_kwargs``); the core builds it on the parameter groups with the lr. A schedule
option gives its lr multiplier per optimizer step (``factor``, after the shared warm-up), or
names a scheduler class of its own (``_target_``, built on the optimizer). No torch import
here: ``--help`` and config mistakes answer before torch is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ddp_utils.config.errors import ConfigError, check_positive, needs_target


@dataclass
class OptimConfig:
    """Every optimizer option's keys."""

    _target_: str = "torch.optim.SGD"  # the optimizer class, built with hydra's instantiate
    name: str = "sgd"
    lr: float = 0.1
    weight_decay: float = 0.0
    norm_weight_decay: float | None = None  # normalisation layers; null = weight_decay
    bias_weight_decay: float | None = None  # biases; null = weight_decay
    # Weight decay on weights of 2 or more dimensions only (nanoGPT's rule): biases and
    # normalisation gains (1-D) take none, whatever norm/bias_weight_decay say.
    decay_2d_only: bool = False

    def optimizer_kwargs(self, sharded: bool = False) -> dict[str, Any]:
        """What the option passes to its class besides the parameter groups and the lr;
        ``sharded``: for parameters sharded as DTensors (trainer.strategy=fsdp2)."""
        return {}

    def check(self) -> None:
        check_positive("optim.lr", self.lr)
        for key in ("weight_decay", "norm_weight_decay", "bias_weight_decay"):
            check_positive(f"optim.{key}", getattr(self, key), allow_zero=True)


@dataclass
class SGDOptim(OptimConfig):
    """optim=sgd: SGD with momentum, fused (one kernel per parameter, on the CPU too, where it
    is faster than the foreach implementation)."""

    momentum: float = 0.9
    nesterov: bool = False

    def optimizer_kwargs(self, sharded: bool = False) -> dict[str, Any]:
        # torch's fused SGD has no rule for DTensors; its multi-tensor path has
        kernel = {"foreach": True} if sharded else {"fused": True}
        return {"momentum": self.momentum, "nesterov": self.nesterov, **kernel}

    def check(self) -> None:
        super().check()
        check_positive("optim.momentum", self.momentum, allow_zero=True)
        if self.nesterov and self.momentum == 0:
            raise ConfigError("optim.nesterov=true needs optim.momentum > 0.")


@dataclass
class AdamWOptim(OptimConfig):
    """optim=adamw: fused AdamW (one kernel per parameter; faster than foreach on a CPU too)."""

    _target_: str = "torch.optim.AdamW"
    name: str = "adamw"
    lr: float = 0.001
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])

    def optimizer_kwargs(self, sharded: bool = False) -> dict[str, Any]:
        return {"betas": tuple(self.betas), "fused": True}  # fused AdamW runs on DTensors too

    def check(self) -> None:
        super().check()
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(
                f"optim.betas={list(self.betas)} needs two values in [0, 1), e.g. [0.9,0.95]."
            )


@dataclass
class CustomOptim(OptimConfig):
    """optim=custom: your optimizer class, given the parameter groups (with their weight
    decay), ``lr=optim.lr`` and its ``+optim.NAME=VALUE`` arguments."""

    _target_: str = ""
    name: str = "custom"
    kwargs: dict[str, Any] = field(default_factory=dict)  # +optim.NAME=VALUE

    def optimizer_kwargs(self, sharded: bool = False) -> dict[str, Any]:
        return dict(self.kwargs)

    def check(self) -> None:
        super().check()
        if not self._target_:
            raise needs_target(
                "optim",
                "pkg.module.Optimizer (a torch.optim class, or a function of (params, lr, ...) "
                "returning one)",
            )


OPTIM_OPTIONS: dict[str, type[OptimConfig]] = {
    "sgd": SGDOptim, "adamw": AdamWOptim, "custom": CustomOptim,
}  # fmt: skip


@dataclass
class SchedConfig:
    """Every schedule option's keys: the warm-up they share. The base is a constant lr."""

    _target_: str | None = None  # a scheduler class of the option's own; null = ``factor``
    name: str = "none"
    warmup_steps: int = 0  # linear warmup from warmup_start_factor * lr
    warmup_epochs: int = 0  # the same in epochs (one of the two)
    warmup_start_factor: float = 0.1

    def warmup(self, steps_per_epoch: int) -> int:
        """The warm-up in optimizer steps."""
        return self.warmup_steps or self.warmup_epochs * steps_per_epoch

    def lr_factor(self, step: int, total: int, steps_per_epoch: int, base_lr: float) -> float:
        """The multiplier of the base lr after ``step`` optimizer steps: the warm-up, then
        the option's ``factor``."""
        warmup = self.warmup(steps_per_epoch)
        if step < warmup:
            return self.warmup_start_factor + (1.0 - self.warmup_start_factor) * step / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return self.factor(step, progress, steps_per_epoch, base_lr)

    def factor(self, step: int, progress: float, steps_per_epoch: int, base_lr: float) -> float:
        """After the warm-up, at ``progress`` (0 to 1) of the rest of the run."""
        return 1.0

    def scheduler_kwargs(self, base_lr: float, total: int) -> dict[str, Any]:
        """The arguments of the option's own scheduler class (with ``_target_``)."""
        return {}

    def check(self) -> None:
        check_positive("sched.warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("sched.warmup_epochs", self.warmup_epochs, allow_zero=True)
        if self.warmup_steps and self.warmup_epochs:
            raise ConfigError(
                "sched.warmup_steps and sched.warmup_epochs are both set: keep one, set the "
                "other to 0."
            )
        if not 0.0 < self.warmup_start_factor <= 1.0:
            raise ConfigError("sched.warmup_start_factor must lie in (0, 1].")


@dataclass
class CosineSched(SchedConfig):
    """sched=cosine: cosine decay to ``min_lr`` over the run."""

    name: str = "cosine"
    min_lr: float = 0.0

    def factor(self, step: int, progress: float, steps_per_epoch: int, base_lr: float) -> float:
        floor = self.min_lr / base_lr
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def check(self) -> None:
        super().check()
        check_positive("sched.min_lr", self.min_lr, allow_zero=True)


@dataclass
class PolySched(SchedConfig):
    """sched=poly: the segmentation references' ``(1 - progress) ** power``."""

    name: str = "poly"
    power: float = 0.9

    def factor(self, step: int, progress: float, steps_per_epoch: int, base_lr: float) -> float:
        return (1.0 - progress) ** self.power

    def check(self) -> None:
        super().check()
        check_positive("sched.power", self.power)


@dataclass
class StepSched(SchedConfig):
    """sched=step: the lr times ``gamma`` every ``step_epochs`` epochs."""

    name: str = "step"
    step_epochs: int = 10
    gamma: float = 0.1

    def factor(self, step: int, progress: float, steps_per_epoch: int, base_lr: float) -> float:
        return self.gamma ** (step // (self.step_epochs * steps_per_epoch))

    def check(self) -> None:
        super().check()
        check_positive("sched.step_epochs", self.step_epochs)
        check_positive("sched.gamma", self.gamma)


@dataclass
class OneCycleSched(SchedConfig):
    """sched=onecycle: torch's OneCycleLR, warm-up for ``pct_start`` of the run to optim.lr,
    then annealing; it cycles the momentum (or AdamW's beta1) the other way."""

    _target_: str | None = "torch.optim.lr_scheduler.OneCycleLR"
    name: str = "onecycle"
    pct_start: float = 0.3

    def scheduler_kwargs(self, base_lr: float, total: int) -> dict[str, Any]:
        return {"max_lr": base_lr, "total_steps": max(2, total), "pct_start": self.pct_start}

    def check(self) -> None:
        super().check()
        if self.warmup_steps or self.warmup_epochs:
            raise ConfigError(
                "sched=onecycle warms up by itself (sched.pct_start): set sched.warmup_steps=0 "
                "and sched.warmup_epochs=0."
            )
        if not 0 < self.pct_start < 1:
            raise ConfigError(f"sched.pct_start={self.pct_start} must lie in (0, 1).")


@dataclass
class CustomSched(SchedConfig):
    """sched=custom: your scheduler class, given the optimizer and its
    ``+sched.NAME=VALUE`` arguments, stepped once per optimizer step."""

    name: str = "custom"
    kwargs: dict[str, Any] = field(default_factory=dict)  # +sched.NAME=VALUE

    def scheduler_kwargs(self, base_lr: float, total: int) -> dict[str, Any]:
        return dict(self.kwargs)

    def check(self) -> None:
        super().check()
        if not self._target_:
            raise needs_target(
                "sched", "pkg.module.Scheduler (a torch LRScheduler class, given the optimizer)"
            )


SCHED_OPTIONS: dict[str, type[SchedConfig]] = {
    "none": SchedConfig, "cosine": CosineSched, "poly": PolySched, "step": StepSched,
    "onecycle": OneCycleSched, "custom": CustomSched,
}  # fmt: skip
