"""What a strategy is: how the model is distributed over the ranks, and everything that
depends on it. The training loop, resume and checkpoints call these methods and never look
inside the wrapped model."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_utils.checkpoint import save_training_checkpoint
from ddp_utils.config import TrainerConfig
from ddp_utils.dist import Runtime, broadcast_buffers
from ddp_utils.models import memory_format_of
from ddp_utils.models.ema import EMA


class Strategy:
    """One per run, built from ``trainer.*`` and the runtime. ``wrap`` is called once with the
    model as built (``raw_model``, the module checkpoints and evaluation know); ``model`` is
    what the training forward runs. The defaults here are a single process's: nothing to
    synchronise, the main rank writes whole state dicts."""

    def __init__(self, trainer: TrainerConfig, rt: Runtime) -> None:
        self.trainer, self.rt = trainer, rt
        self.model: nn.Module | None = None
        self.raw_model: nn.Module | None = None

    def wrap(self, raw_model: nn.Module) -> nn.Module:
        """Place ``raw_model`` on the device (in the trainer's memory format), distribute it,
        compile it with ``trainer.compile``; return the module the training forward runs."""
        raw_model = self.prepare(raw_model)
        raw_model.to(self.rt.device, memory_format=memory_format_of(self.trainer.channels_last))
        self.raw_model = raw_model
        self.model = self.distribute(raw_model)
        if self.trainer.compile:
            self.model = torch.compile(self.model)
        return self.model

    def prepare(self, raw_model: nn.Module) -> nn.Module:
        """The module as the strategy needs it before it is placed (DDP: SyncBatchNorm)."""
        return raw_model

    def distribute(self, raw_model: nn.Module) -> nn.Module:
        """The module the training forward runs, around the placed ``raw_model``."""
        return raw_model

    @property
    def eval_model(self) -> nn.Module:
        """What validation scores (its buffers synchronised first): the unwrapped module."""
        return self.raw_model

    def no_sync(self) -> AbstractContextManager:
        """Hold gradient synchronisation back during accumulation's early micro-batches."""
        return nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients' global norm (over every rank's share of the parameters)."""
        return nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)

    def sync_buffers(self, modules: Sequence[nn.Module]) -> None:
        """Give every rank rank 0's buffers (BatchNorm's running statistics) of ``modules``:
        what is validated and saved is then what every rank holds."""
        broadcast_buffers(modules)

    def make_ema(self, decay: float, every_steps: int) -> EMA:
        return EMA(self.raw_model, decay, every_steps)

    def update_ema(self, ema: EMA, step: int, in_warmup: bool) -> None:
        ema.update(self.raw_model, step, in_warmup)

    # What a checkpoint holds of the model and optimizer, and how it is written. Every rank
    # calls each of these.
    def model_state_dict(self) -> dict[str, Any]:
        return self.raw_model.state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.raw_model.load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)

    def save(
        self, state: dict[str, Any], ckpt_dir: Path, also: tuple[str, ...], keep_last: int
    ) -> Path:
        """Write the checkpoint: whole state dicts, by the main rank (every rank waits)."""
        return save_training_checkpoint(state, ckpt_dir, also, keep_last, self.rt)
