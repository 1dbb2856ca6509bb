"""Mixed precision: ``trainer.precision`` (auto, 32, bf16, fp16) and its autocast contexts, and
the numerics switches a run sets (``trainer.deterministic``, cuDNN autotuning, TF32)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ddp_utils.config import TrainerConfig
from ddp_utils.hardware import (
    BackendFlags,
    Cuda,
    apply_backend_flags,
    auto_precision,
    backend_flags,
    check_precision,
    probe_cuda,
)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(
    precision: str, device: torch.device, model: Any = None, cuda: Cuda | None = None
) -> str:
    """``auto``: what was measured faster (docs/speed.md). On CUDA bf16 from Ampere on, fp16
    with a gradient scaler before. On a CPU bf16 only with AMX tiles, and only for a model
    option that declares ``bf16_on_cpu`` (the tutorial's ConvNet, the GPT); a ResNet trains
    slower there in bf16, as every model does without AMX.
    An explicit bf16 on a GPU without bf16 units is refused (ConfigError)."""
    if cuda is None:
        cuda = probe_cuda(index=device.index or 0) if device.type == "cuda" else Cuda()
    if precision == "auto":
        amx = device.type == "cpu" and torch.cpu._is_amx_tile_supported()
        return auto_precision(device.type, cuda, amx, getattr(model, "bf16_on_cpu", False))
    check_precision(precision, device.type, cuda)
    return precision


def amp_context(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A factory of autocast contexts for a resolved ``precision`` (no-op for full precision)."""
    assert precision != "auto", "resolve_precision first"
    if precision == "32":
        return contextlib.nullcontext
    dtype = AMP_DTYPES[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def set_numerics(
    trainer: TrainerConfig, device: torch.device, fixed_input_shapes: bool = True
) -> BackendFlags:
    """cuDNN autotuning (for inputs of ``fixed_input_shapes``, the task says) and TF32 on CUDA
    (off with ``trainer.deterministic``), and torch's deterministic algorithms with it: set for
    every run, so a sweep's jobs do not inherit the previous job's. Returns what was set."""
    flags = backend_flags(device.type, trainer.deterministic, fixed_input_shapes)
    apply_backend_flags(flags, device.type)
    return flags
