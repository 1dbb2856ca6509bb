"""Main-rank records of a run: TensorBoard scalars and the environment it ran in."""

from __future__ import annotations

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
from ddp_utils.run import log


class Tracker:
    """``logger=tensorboard``: scalars into ``run_dir/tb`` from the main rank; else nothing."""

    def __init__(self, kind: str, run_dir: Path, rt: Runtime) -> None:
        self.enabled = kind == "tensorboard" and rt.is_main
        self.log_dir, self.writer = run_dir / "tb", None

    def _open(self) -> None:
        # Opened at the first record, so importing tensorboard does not delay the first step.
        self.enabled = False
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning("logger=tensorboard but the tensorboard package is missing: "
                        "pip install tensorboard, or set logger=none")  # fmt: skip
            return
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.enabled:
            self._open()
        if self.writer is not None:
            try:
                for key, value in values.items():
                    self.writer.add_scalar(key, value, step)
            except OSError as e:
                self._give_up(e)

    def _give_up(self, e: OSError) -> None:
        # TensorBoard is a view of metrics.jsonl: a full disk stops it, not the training
        # (whose next checkpoint or metrics line reports the disk, on every rank at once).
        log.warning("TensorBoard logging stopped: cannot write %s (%s)", self.log_dir,
                    e.strerror or e)  # fmt: skip
        self.writer = None

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as e:
                self._give_up(e)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: allocated on the GPU, resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


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
