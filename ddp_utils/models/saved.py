"""What a checkpoint holds of a model: every parameter and buffer, or, for a model that sets
``saves_frozen = False`` (LoRA adapters on a pretrained base), all but its frozen parameters,
which come back from where the model is built (the base folder) on resume and in eval.py."""

from __future__ import annotations

from typing import Any

from torch import nn


def saves_frozen(model: nn.Module) -> bool:
    return bool(getattr(model, "saves_frozen", True))


def frozen_keys(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def saved_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (the model's state dict) less what a checkpoint leaves out."""
    if saves_frozen(model):
        return state
    frozen = frozen_keys(model)
    return {k: v for k, v in state.items() if k not in frozen}


def load_saved_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load what ``saved_state`` kept: strict, but for the frozen parameters a model leaves
    out (a RuntimeError names any other missing or unexpected key)."""
    if saves_frozen(model):
        model.load_state_dict(state)
        return
    result = model.load_state_dict(state, strict=False)
    missing = sorted(set(result.missing_keys) - frozen_keys(model))
    if missing or result.unexpected_keys:
        raise RuntimeError(
            "Error(s) in loading state_dict:\n"
            f"missing keys {missing[:4]}, unexpected keys {sorted(result.unexpected_keys)[:4]}"
        )
