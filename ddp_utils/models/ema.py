"""An exponential moving average of the weights, kept and adjusted as torchvision's
classification references keep theirs (``torch.optim.swa_utils.AveragedModel``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def ema_decay(decay: float, every_steps: int, global_batch: int, epochs: int) -> float:
    """The references' adjustment: ``trainer.ema_decay`` is per sample of an epoch-long run,
    so the decay applied at each update depends on how many samples pass between updates."""
    adjust = global_batch * every_steps / epochs
    return 1.0 - min(1.0, (1.0 - decay) * adjust)


class EMA:
    """Updated every ``every_steps`` optimizer steps; during the learning-rate warm-up it copies
    the weights instead of averaging them (the references reset ``n_averaged`` there)."""

    def __init__(self, model: nn.Module, decay: float, every_steps: int) -> None:
        self.every_steps, self.decay = every_steps, decay
        self.averaged = AveragedModel(
            model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True
        )

    @property
    def module(self) -> nn.Module:
        return self.averaged.module

    def update(self, model: nn.Module, step: int, in_warmup: bool) -> None:
        if step % self.every_steps:
            return
        self.averaged.update_parameters(model)
        if in_warmup:
            self.averaged.n_averaged.fill_(0)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "n_averaged": self.averaged.n_averaged.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.averaged.n_averaged.copy_(torch.as_tensor(state["n_averaged"]))
