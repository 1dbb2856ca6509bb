"""Does the model fit the data? One forward of two blank images of the data's shape, before the
first step and in eval.py, so that a wrong class count or image size stops with the fix instead
of training silently on a wrong head or failing deep inside the loss.
"""

from __future__ import annotations

import inspect

import torch
from hydra.utils import get_object
from torch import nn

from ddp_utils.config import ConfigError, DataConfig, ModelConfig

PROBE_BATCH = 2  # BatchNorm needs more than one value per channel (it is in eval mode anyway)
# Sizes tried, only after a failure, to tell the user which one the model takes.
PROBE_SIZES = (16, 32, 64, 96, 128, 160, 192, 224, 256, 299, 384)


@torch.no_grad()
def probe(model: nn.Module, channels: int, size: int, device: torch.device,
          memory_format: torch.memory_format) -> torch.Tensor:  # fmt: skip
    """``model``'s output for ``PROBE_BATCH`` blank images; eval mode, so no running
    statistic moves and no random number is drawn."""
    was_training = model.training
    model.eval()
    try:
        x = torch.zeros(PROBE_BATCH, channels, size, size, device=device)
        out = model(x.contiguous(memory_format=memory_format))
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"the model returned {type(out).__name__}, not a tensor of logits: return the "
            "logits tensor from forward() (in eval mode too)."
        )
    return out


def describe(cfg: ModelConfig) -> str:
    """The model option; for ``model=custom`` its target with the constructor's parameters
    (so a class count under another name, ``n_out``, say, is visible) and what it was given."""
    if cfg.name != "custom":
        return f"model={cfg.name}" + (f" model.arch={cfg.arch}" if cfg.arch else "")
    try:
        params = inspect.signature(get_object(cfg._target_)).parameters.values()
        signature = ", ".join(
            p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params
        )
    except (ValueError, TypeError, ImportError):
        signature = "..."
    given = f", given {dict(cfg.kwargs)}" if cfg.kwargs else ""
    return f"model._target_={cfg._target_} (its parameters: {signature}{given})"


def check_output(
    model: nn.Module,
    cfg: ModelConfig,
    data: DataConfig,
    device: torch.device,
    memory_format: torch.memory_format,
    expected: tuple[int, ...],
    what: str,
) -> torch.Tensor:
    """Refuse a model whose output for ``PROBE_BATCH`` images is not ``expected`` (``what``
    says which config keys decide it), or which cannot take ``data.image_size`` images;
    return that output."""
    channels, size = data.in_channels, data.image_size
    try:
        out = probe(model, channels, size, device, memory_format)
    except ConfigError:
        raise
    except Exception as e:  # a size the model cannot take, or a bug of the model's
        larger = (s for s in PROBE_SIZES if s > size)
        fits = next((s for s in larger if _runs(model, channels, s, device, memory_format)), None)
        if fits is None:
            raise  # not the image size: a bug in the model, with its traceback
        last = (str(e).strip().splitlines() or [""])[-1][:200]
        raise ConfigError(
            f"{describe(cfg)} cannot take data.image_size={size} images ({type(e).__name__}: "
            f"{last}). It runs at data.image_size={fits}: set that (and data.resize_size for "
            "image folders), or pick a model made for smaller images."
        ) from None
    shape = tuple(out.shape)
    if shape != expected:
        raise ConfigError(
            f"the output of {describe(cfg)} for a batch of {PROBE_BATCH} images of "
            f"{channels}x{size}x{size} has shape {shape}, but {what} needs {expected}. Build "
            "the model for it (model=custom: pass the class count under the name its "
            "constructor takes, +model.NAME=VALUE), or correct the data's settings."
        )
    return out


def _runs(model: nn.Module, channels: int, size: int, device: torch.device,
          memory_format: torch.memory_format) -> bool:  # fmt: skip
    try:
        probe(model, channels, size, device, memory_format)
    except Exception:
        return False
    return True
