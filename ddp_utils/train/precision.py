"""Mixed precision: ``trainer.precision`` (auto, 32, bf16, fp16) and its autocast contexts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bf16 natively: CUDA from compute capability 8.0 (Ampere),
    CPUs with AMX tiles or AVX512-BF16."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    if device.type == "cpu":
        return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return False


def resolve_precision(precision: str, device: torch.device, model: Any = None) -> str:
    """``auto``: bf16 where it was measured faster (docs/speed.md), else full precision.
    CUDA from Ampere on. On a CPU only with AMX tiles, and only for a model option that
    declares ``bf16_on_cpu`` (the tutorial's ConvNet: 1.44x at 28 px); a GPT (0.74x) or a
    ResNet (0.90x) train slower there in bf16, as every model does without AMX."""
    if precision != "auto":
        return precision
    if device.type == "cpu":
        fast = torch.cpu._is_amx_tile_supported() and getattr(model, "bf16_on_cpu", False)
        return "bf16" if fast else "32"
    return "bf16" if native_bf16(device) else "32"


def amp_context(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A factory of autocast contexts for a resolved ``precision`` (no-op for full precision)."""
    assert precision != "auto", "resolve_precision first"
    if precision == "32":
        return contextlib.nullcontext
    dtype = AMP_DTYPES[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)
