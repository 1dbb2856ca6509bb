"""The environment a run ran in (env.json) and its peak memory."""

from __future__ import annotations

import contextlib
import json
import platform
import resource
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_utils.dist import Runtime


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process since ``reset_peak_memory``: allocated on the GPU,
    resident on the CPU (Linux's VmHWM; the process's whole life where that is missing)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak_memory(device: torch.device) -> None:
    """Start ``peak_memory_mb`` anew (each job of an in-process sweep reports its own)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: the resident high-water mark (VmHWM) back to the current size


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(rt: Runtime) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "gloo": dist.is_gloo_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "world_size": rt.world_size,
        "backend": rt.backend,
        "device": str(rt.device),
        "git_commit": git_commit(),
        "argv": sys.argv,
    }


def environment_text(rt: Runtime) -> str:
    return json.dumps(environment(rt), indent=2)
