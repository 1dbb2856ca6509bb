"""What is never written: a non-finite loss or weight ends the run (``NonFiniteError``, naming
the last good checkpoint) instead of being saved."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ddp_utils.config import UserError

if TYPE_CHECKING:
    from ddp_utils.checkpoint.state import TrainingState

DIVERGED_EXIT = 3


class NonFiniteError(UserError):
    """The loss or the weights became NaN or infinite: the hyper-parameters need a change."""

    exit_code = DIVERGED_EXIT


def all_finite(tensors: Iterable[Any]) -> bool:
    """One host sync for any number of tensors, also inside nested dicts (only floating ones
    can hold NaN or inf)."""
    flags = [torch.isfinite(t).all() for t in _tensors(tensors) if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def _tensors(items: Iterable[Any]) -> Iterator[torch.Tensor]:
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, dict):
            yield from _tensors(item.values())


def diverged(tr: TrainingState, what: str) -> NonFiniteError:
    """The one message of a diverged run: where, the last good checkpoint, and what to try."""
    last = tr.checkpointer.last_complete() or "none (the run has no checkpoint yet)"
    t = tr.cfg.trainer
    tries = [f"a lower optim.lr (now {tr.cfg.optim.lr:g})"]
    tries.append("trainer.grad_clip=1.0" if t.grad_clip is None else
                 f"a lower trainer.grad_clip (now {t.grad_clip:g})")  # fmt: skip
    if t.precision != "32":  # not a suggestion to make when it is in force already
        tries.append(f"trainer.precision=32 (now {t.precision})")
    return NonFiniteError(
        f"{what} is not finite (NaN or inf) at step {tr.step}, epoch {tr.epoch}: the run "
        f"stopped, and nothing non-finite was saved. Last good checkpoint: {last}. Try "
        f"{', '.join(tries[:-1])} or {tries[-1]}; relaunching in this run_dir continues from "
        "the last good checkpoint."
    )


def check_state(tr: TrainingState, loss_sum: torch.Tensor) -> None:
    """Before a checkpoint (every rank: DDP's weights and the all-reduced loss are the same on
    all of them, so all raise together)."""
    if not all_finite([loss_sum]):
        raise diverged(tr, "the training loss")
    weights = list(tr.raw_model.state_dict().values())
    weights += list(tr.ema.state_dict().values()) if tr.ema is not None else []
    if not all_finite(weights):
        raise diverged(tr, "a model weight")
