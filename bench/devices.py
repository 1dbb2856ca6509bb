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


def join_group():
    """A baseline worker under torchrun: NCCL and cuda:LOCAL_RANK on CUDA, else gloo and the
    CPU; returns the device."""
    import torch
    import torch.distributed as dist

    if bench_device() == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
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
