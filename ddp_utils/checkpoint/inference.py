"""A checkpoint turned back into a model, for eval.py and generate.py: the model its config
describes, with its weights (or its EMA weights), on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ddp_utils.checkpoint.format import SHARDED_DIR, read_sharded, summary
from ddp_utils.config import ConfigError, TrainConfig, whole_sentences
from ddp_utils.models import build_model
from ddp_utils.models.saved import load_saved_state, saved_state


def load_model_state(model: nn.Module, state: dict[str, Any], where: str, fix: str) -> None:
    """Load a state dict, turning a shape or key mismatch into a message the user can act on."""
    try:
        load_saved_state(model, state)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        detail = (whole_sentences(lines[0]) if lines else "") or summary(e)
        raise ConfigError(
            f"{where} does not fit the model built from the config ({detail}). {fix}"
        ) from None


def model_weights(
    ckpt: dict[str, Any], checkpoint: str | Path, ema: bool, model: nn.Module
) -> dict[str, Any]:
    """The checkpoint's model weights, or with ``ema=true`` its EMA weights (a sharded
    checkpoint's read whole, in the shapes of ``model``'s state dict)."""
    if SHARDED_DIR in ckpt:
        if ema and "model_ema" not in ckpt["sharded"]:
            raise ConfigError(f"ema=true but checkpoint={checkpoint} holds no EMA weights: "
                              "train with trainer.ema_decay, or drop ema=true.")  # fmt: skip
        template = {"model": saved_state(model, model.state_dict())}
        read_sharded(ckpt, {"model_ema": template} if ema else template, alone=True)
        return template["model"]
    if not ema:
        return ckpt["model"]
    if "model_ema" not in ckpt:
        raise ConfigError(
            f"ema=true but checkpoint={checkpoint} holds no EMA weights: train with "
            "trainer.ema_decay=0.9999 (for example), or drop ema=true."
        )
    return ckpt["model_ema"]["model"]


def inference_model(
    ckpt: dict[str, Any],
    checkpoint: str | Path,
    train_cfg: TrainConfig,
    ema: bool,
    num_outputs: int | None = None,
    fix: str = "Give a train.py checkpoint.",
) -> nn.Module:
    """The model ``train_cfg`` describes, with the checkpoint's weights (its EMA weights with
    ``ema``), on the CPU; ``fix`` is what to do when they do not fit."""
    model = build_model(train_cfg.model, train_cfg.data, num_outputs)
    weights = model_weights(ckpt, checkpoint, ema, model)
    load_model_state(model, weights, f"checkpoint={checkpoint}", fix)
    return model
