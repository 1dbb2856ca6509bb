"""Does the model fit the data? One forward of two blank images of the data's shape, before the
first step and in eval.py, so that a wrong class count or image size stops with the fix instead
of training silently on a wrong head or failing deep inside the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ddp_utils.config import ConfigError, DataConfig, ModelConfig
from ddp_utils.instantiate import why

PROBE_BATCH = 2  # BatchNorm needs more than one value per channel (it is in eval mode anyway)
# Sizes tried, only after a failure, to tell the user which one the model takes.
PROBE_SIZES = (16, 32, 64, 96, 128, 160, 192, 224, 256, 299, 384)


def blank_images(data: DataConfig, size: int, device: torch.device,
                 memory_format: torch.memory_format) -> torch.Tensor:  # fmt: skip
    """``PROBE_BATCH`` black images of the data's channels at ``size`` pixels."""
    x = torch.zeros(PROBE_BATCH, data.in_channels, size, size, device=device)
    return x.contiguous(memory_format=memory_format)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode, no gradients: no running statistic moves, no random number is drawn."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def describe(cfg: ModelConfig) -> str:
    return cfg.describe()


def check_logits(out: object, cfg: ModelConfig, data: DataConfig, expected: tuple[int, ...],
                 what: str) -> None:  # fmt: skip
    """Refuse an output that is not a tensor of shape ``expected`` (``what``: the config keys
    that decide it)."""
    if isinstance(out, Mapping) and "out" in out:
        raise ConfigError(
            f"{describe(cfg)} is a segmentation model (its output is a dict of "
            f"{', '.join(map(str, out))}), but this run's task wants {what}: use "
            "task=segmentation with a segmentation data option (data=digits_seg | segfolder | "
            "voc | mnist_seg, or experiment=digits_segmentation)."
        )
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"the model returned {type(out).__name__}, not a tensor of logits: return the "
            "logits tensor from forward() (in eval mode too)."
        )
    if tuple(out.shape) != expected:
        raise ConfigError(
            f"the output of {describe(cfg)} for a batch of {PROBE_BATCH} {data.describe_inputs()} "
            f"has shape {tuple(out.shape)}, but {what} needs "
            f"{expected}. Build the model for it (model=custom: pass the class count under the "
            "name its constructor takes, +model.NAME=VALUE), or correct the data's settings."
        )


def size_error(model: nn.Module, cfg: ModelConfig, data: DataConfig, device: torch.device,
               memory_format: torch.memory_format, e: Exception) -> ConfigError | None:  # fmt: skip
    """After ``model`` failed on ``data.image_size`` images with ``e``: the error naming the
    size it runs at, or None when no size helps (a bug in the model)."""
    for size in (s for s in PROBE_SIZES if s > data.image_size):
        try:
            with eval_mode(model):
                model(blank_images(data, size, device, memory_format))
        except Exception:
            continue
        return ConfigError(
            f"{describe(cfg)} cannot take data.image_size={data.image_size} images ({why(e)}). "
            f"It runs at data.image_size={size}: set that (and data.resize_size for image "
            "folders), or pick a model made for smaller images."
        )
    return None
