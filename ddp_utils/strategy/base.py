"""What a strategy is: how the model is distributed over the ranks, and everything that
depends on it. The training loop, resume and checkpoints call these methods and never look
inside the wrapped model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from ddp_utils.config import ConfigError, TrainerConfig
from ddp_utils.dist import Runtime, broadcast_buffers
from ddp_utils.models import memory_format_of
from ddp_utils.models.ema import EMA
from ddp_utils.models.saved import load_saved_state, saved_state


def model_units(model: nn.Module, wrap: list[str] | None, key: str) -> list[nn.Module]:
    """The model's units (what fsdp2 shards before the root, what activation checkpointing
    recomputes), innermost first. ``wrap``: by class name; else the
    model's ``fsdp_units()``; else its top-level children that hold parameters of their own
    (one sharing a parameter with another, such as a tied embedding, stays with the root; a
    container without a forward, such as a ModuleList, gives its children instead)."""
    if wrap is not None:
        names = set(wrap)
        units = [m for m in model.modules()
                 if type(m).__name__ in names and m is not model and has_forward(m)]  # fmt: skip
        if not units:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"{key}={list(wrap)}: the model has no module of these classes; "
                f"it has {', '.join(present[:30])}. Name some of those, or leave "
                f"{key}=null for the model's own blocks."
            )
        return list(reversed(units))  # children before the blocks that hold them
    if hasattr(model, "fsdp_units"):
        return list(model.fsdp_units())
    children = [c for c in forward_children(model) if any(True for _ in c.parameters())]
    owners: dict[int, int] = {}
    for c in children:
        for p in c.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [c for c in children if all(owners[id(p)] == 1 for p in c.parameters())]


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` runs as a unit (``ModuleList``, ``ModuleDict`` only hold modules)."""
    return type(module).forward is not nn.Module.forward


def forward_children(model: nn.Module) -> list[nn.Module]:
    """``model``'s children, a container without a forward replaced by its own children
    (recursively): ``fully_shard`` and activation checkpointing wrap a forward."""
    found = []
    for child in model.children():
        found += [child] if has_forward(child) else forward_children(child)
    return found


def checkpoint_activations(model: nn.Module, units: list[nn.Module]) -> None:
    """Keep only each unit's inputs in the forward and recompute the rest in its backward
    (torch's checkpoint wrapper, non-reentrant, put in place of each unit; state dicts keep
    their keys)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    chosen = {id(u) for u in units}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in chosen,
    )


# The trainer keys that only some strategies read, and the built-in one that does: a strategy
# that does not read one refuses a value other than its default (a silent no-op otherwise).
STRATEGY_KEYS = {
    "ddp.comm_hook": "ddp", "ddp.powersgd_rank": "ddp", "ddp.powersgd_start_iter": "ddp",
    "ddp.sync_bn": "ddp", "ddp.bucket_cap_mb": "ddp", "ddp.gradient_as_bucket_view": "ddp",
    "ddp.static_graph": "ddp", "fsdp.reshard_after_forward": "fsdp2", "fsdp.cpu_offload": "fsdp2",
    "fsdp.replicate": "fsdp2",
}  # fmt: skip


def refuse_unread_keys(trainer: TrainerConfig, reads: tuple[str, ...]) -> None:
    """ConfigError naming the first strategy key set away from its default that ``reads``
    leaves out."""
    default = TrainerConfig()
    for key, owner in STRATEGY_KEYS.items():
        if key in reads:
            continue
        value, was = (OmegaConf.select(OmegaConf.structured(c), key) for c in (trainer, default))
        if value != was:
            raise ConfigError(
                f"trainer.{key}={shown(value)} is trainer.strategy={owner}'s; this run's "
                f"trainer.strategy={trainer.strategy} does not use it. Drop the override "
                f"(trainer.{key}={shown(was)}), or train with trainer.strategy={owner}."
            )


def shown(value: Any) -> str:
    """A value as a command-line override writes it."""
    if isinstance(value, bool) or value is None:
        return "null" if value is None else str(value).lower()
    return str(value)


class Strategy:
    """One per run, built from ``trainer.*`` and the runtime. ``wrap`` is called once with the
    model as built (``raw_model``, the module checkpoints and evaluation know); ``model`` is
    what the training forward runs. The defaults here are a single process's: nothing to
    synchronise, the main rank writes whole state dicts."""

    # Whether every forward is a collective, so that evaluation must run the same number of
    # forwards on every rank (ddp_utils.evaluation.evaluate).
    lockstep_eval: bool = False
    # Whether parameters are DTensor shards: the optimizer is built for them and checkpoints
    # are sharded folders (ddp_utils.checkpoint.format).
    shards_parameters: bool = False

    # Which of STRATEGY_KEYS this strategy reads (the others must keep their defaults).
    reads: tuple[str, ...] = ()

    @classmethod
    def check(cls, trainer: TrainerConfig, rt: Runtime) -> None:
        """ConfigError for keys this strategy cannot take at this runtime, before a run starts."""
        refuse_unread_keys(trainer, cls.reads)

    def __init__(self, trainer: TrainerConfig, rt: Runtime) -> None:
        self.check(trainer, rt)
        self.trainer, self.rt = trainer, rt
        self.model: nn.Module | None = None
        self.raw_model: nn.Module | None = None

    def build(self, make: Callable[[], nn.Module]) -> nn.Module:
        """The model ``make`` builds (every rank calls it, seeded alike): where its weights
        are first made is the strategy's choice."""
        return make()

    def whole_model(self) -> nn.Module | None:
        """Every rank calls it: the trained model whole on the main rank (None elsewhere), for
        what the main rank alone computes with it (the pictures of predictions)."""
        return self.raw_model if self.rt.is_main else None

    def wrap(self, raw_model: nn.Module) -> nn.Module:
        """Place ``raw_model`` on the device (in the trainer's memory format), distribute it,
        compile it with ``trainer.compile``; return the module the training forward runs."""
        raw_model = self.prepare(raw_model)
        if self.trainer.activation_checkpointing:
            units = model_units(raw_model, self.trainer.activation_checkpointing_units,
                                "trainer.activation_checkpointing_units")  # fmt: skip
            checkpoint_activations(raw_model, units)
        self.place(raw_model)
        self.raw_model = raw_model
        self.model = self.distribute(raw_model)
        if self.trainer.compile:
            self.model = torch.compile(self.model)
        return self.model

    def place(self, raw_model: nn.Module) -> None:
        """Move the whole model onto the device, in the trainer's memory format."""
        raw_model.to(self.rt.device, memory_format=memory_format_of(self.trainer.channels_last))

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

    def make_scaler(self, enabled: bool) -> torch.amp.GradScaler:
        """fp16's gradient scaler. Every rank holds whole gradients, all-reduced alike, so
        every rank finds the same overflows."""
        return torch.amp.GradScaler(self.rt.device.type, enabled=enabled)

    def sync_buffers(self, modules: Sequence[nn.Module]) -> None:
        """Give every rank rank 0's buffers (BatchNorm's running statistics) of ``modules``:
        what is validated and saved is then what every rank holds."""
        broadcast_buffers(modules)

    def make_ema(self, decay: float, every_steps: int) -> EMA:
        return EMA(self.raw_model, decay, every_steps)

    def update_ema(self, ema: EMA, step: int, in_warmup: bool) -> None:
        ema.update(self.raw_model, step, in_warmup)

    # What a checkpoint holds of the model and optimizer (ddp_utils.checkpoint reads and
    # writes them; the format is its own). Every rank calls each of these.

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state a resume needs (a compression hook's), plain tensors;
        what the main rank returns is saved."""
        return {}

    def load_state_dict(self, state: dict[str, Any], world_size: int) -> None:
        """Restore what ``state_dict()`` returned, saved at ``world_size``."""

    def model_state_dict(self) -> dict[str, Any]:
        return saved_state(self.raw_model, self.raw_model.state_dict())

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        load_saved_state(self.raw_model, state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)
