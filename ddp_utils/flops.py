"""Model FLOPs utilisation (MFU): the FLOPs a model's training takes per sample, against what
the device could do at most.

A model's FLOPs per sample come from its own formula where it has one (a ``flops_per_sample()``
method: the GPT's, as nanoGPT and torchtitan count it), else from torch's ``FlopCounterMode``
over one forward (the model check before training runs it), times 3 for the backward (twice
the forward's matmuls, the usual convention of PaLM and nanoGPT). A device's peak is
``trainer.peak_flops`` when set, else a GPU's datasheet value for the run's precision, else
measured: a short matmul in the run's dtype on this device, cached per machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Dense peak tera-FLOP/s of one GPU, by a substring of its name (the first that matches):
# (bf16/fp16 tensor cores, tf32, fp32). Datasheet values without sparsity.
GPU_PEAK_TFLOPS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("H200 NVL", (835.0, 417.5, 60.0)),
    ("H200", (989.0, 494.7, 67.0)),
    ("H100 NVL", (835.0, 417.5, 60.0)),
    ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H100", (989.0, 494.7, 67.0)),  # SXM
    ("GH200", (989.0, 494.7, 67.0)),
    ("B200", (2250.0, 1100.0, 80.0)),
    ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("L40", (181.0, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A10G", (70.0, 35.0, 31.2)),
    ("A10", (125.0, 62.5, 31.2)),
    ("RTX 4090", (165.2, 82.6, 82.6)),
    ("RTX 3090", (71.0, 35.6, 35.6)),
    ("V100", (125.0, 15.7, 15.7)),  # fp16 tensor cores; no bf16
    ("T4", (65.0, 8.1, 8.1)),
)
CPU_PROBE_S = 0.3  # how long the matmul probe of a CPU runs


def training_flops_per_sample(model: nn.Module, counted_forward: float) -> float:
    """FLOPs of one training sample (forward and backward): the model's own count where it
    defines ``flops_per_sample()``, else 3 x the forward's counted FLOPs."""
    own = getattr(model, "flops_per_sample", None)
    return float(own()) if callable(own) else 3.0 * counted_forward


@contextlib.contextmanager
def counting() -> Iterator[Any]:
    """``FlopCounterMode`` without its table: ``.get_total_flops()`` after the block."""
    from torch.utils import flop_counter

    # torch counts its GPU attention kernels but not the CPU one the same call picks: the same
    # formula (the full T x T products, as nanoGPT counts them) for it.
    aten, registry = torch.ops.aten, flop_counter.flop_registry
    registry.setdefault(aten._scaled_dot_product_flash_attention_for_cpu,
                        registry[aten._scaled_dot_product_flash_attention])  # fmt: skip
    registry.setdefault(aten._scaled_dot_product_flash_attention_for_cpu_backward,
                        registry[aten._scaled_dot_product_flash_attention_backward])  # fmt: skip
    with flop_counter.FlopCounterMode(display=False) as counter:
        yield counter


def gpu_peak_flops(name: str, precision: str, tf32: bool) -> float | None:
    """A GPU's datasheet peak (FLOP/s) in ``precision``; None for a GPU not in the table."""
    for key, (half, tf32_peak, fp32) in GPU_PEAK_TFLOPS:
        if key in name:
            if precision in ("bf16", "fp16"):
                return half * 1e12
            return (tf32_peak if tf32 else fp32) * 1e12
    return None


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ddp-recipes" / "peak_flops.json"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float) -> float:
    """FLOP/s of square matmuls in ``dtype`` on ``device``: the fastest of the rounds run in
    about ``seconds`` (another process's burst slows some rounds, not the fastest)."""
    n = 2048 if device.type == "cuda" or torch.get_num_threads() >= 8 else 1024
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)  # the first call picks kernels
    sync()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end or best == 0.0:
        start = time.perf_counter()
        for _ in range(2):
            torch.mm(a, b)
        sync()
        best = max(best, 2 * 2.0 * n**3 / (time.perf_counter() - start))
    return best


def busy() -> float:
    """This machine's 1-minute load average a core (0 where unknown)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


BUSY = 0.5  # a load a core above which a measured peak is taken again when it is quieter


def measured_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """A CPU's (or an unlisted GPU's) matmul FLOP/s in ``dtype`` with this process's threads,
    measured once per machine and cached in ``~/.cache/ddp-recipes/peak_flops.json`` with the
    machine's load then. A peak measured on a busy machine (other jobs take the cores, so
    every round is slow) is measured again by a later run on a quieter one, and the faster
    kept."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    key = f"{name} | {device.type} | {dtype} | {torch.get_num_threads()} threads"
    path = cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    if isinstance(entry, int | float):  # written before the load was kept: measured again
        entry = {"flops": float(entry), "load": float("inf")}
    load = busy()
    if entry is None or (entry["load"] > BUSY and load < entry["load"]):
        measured = measure_matmul_flops(device, dtype, CPU_PROBE_S)
        best = max(measured, entry["flops"]) if entry else measured
        entry = {"flops": best, "load": load}  # at least what this load allows
        cached[key] = entry
        with contextlib.suppress(OSError):  # a read-only home: measured again next time
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cached, indent=1) + "\n")
            tmp.replace(path)
    return float(entry["flops"])


def peak_flops(
    device: torch.device, precision: str, override: float | None, tf32: bool = False
) -> tuple[float, str]:
    """(FLOP/s one device can do at most in ``precision``, where the number comes from).
    ``tf32``: whether the run's fp32 matmuls use TF32 (its ``BackendFlags``; torch's own
    switches are not read back, see ``hardware.apply_backend_flags``)."""
    if override is not None:
        return override, "trainer.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        listed = gpu_peak_flops(name, precision, tf32)
        if listed is not None:
            return listed, f"the datasheet of {name}"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return measured_peak_flops(device, dtype), "a matmul measured on this machine"


@dataclass(frozen=True)
class Utilisation:
    """What a run's MFU is computed from, found once before training."""

    flops_per_sample: float  # training FLOPs of one sample (forward and backward)
    peak: float  # FLOP/s of one device at most
    source: str  # where ``peak`` comes from
    world_size: int

    def of(self, samples_per_s: float) -> float:
        """The MFU of training at ``samples_per_s``, all ranks together: the fraction of the
        world size's devices' peak that their FLOPs use."""
        return samples_per_s * self.flops_per_sample / (self.world_size * self.peak)

    def describe(self) -> str:
        return (f"{self.flops_per_sample / 1e9:.3g} GFLOP a training sample; peak "
                f"{self.peak / 1e12:.3g} TFLOP/s a device ({self.source})")  # fmt: skip
