"""The device both sides of a benchmark run on: ``DEVICE=cpu|cuda`` (make bench-lm DEVICE=cuda),
cpu by default. train.py gets ``trainer.device=DEVICE``; a baseline loop joins its group with
``join_group`` and reads its clock with ``clock``, which waits for the GPU first."""

from __future__ import annotations

import os
import time

DEVICES = ("cpu", "cuda")


def bench_device() -> str:
    device = os.environ.get("DEVICE", "cpu")
    if device not in DEVICES:
        raise SystemExit(f"DEVICE={device}: choose one of {', '.join(DEVICES)}")
    return device


def ours_device() -> list[str]:
    """train.py's override for the benchmark's device."""
    return [f"trainer.device={bench_device()}"]


def baseline_numerics(device_type: str, fixed_input_shapes: bool = True) -> None:
    """The baseline's TF32 and cuDNN switches as train.py sets them for the same task (TF32
    on CUDA; autotuning where input shapes are fixed), so both sides run the same kernels."""
    from ddp_utils.hardware import apply_backend_flags, backend_flags

    apply_backend_flags(backend_flags(device_type, False, fixed_input_shapes), device_type)


def join_group(fixed_input_shapes: bool = True):
    """A baseline worker under torchrun: NCCL and cuda:LOCAL_RANK on CUDA, else gloo and the
    CPU, with train.py's numerics switches; returns the device."""
    import torch
    import torch.distributed as dist

    if bench_device() == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        baseline_numerics("cuda", fixed_input_shapes)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def clock(device) -> float:
    """``time.perf_counter()`` once the device has finished what it was given."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
