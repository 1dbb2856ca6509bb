"""Shared helpers: launching the real entry scripts under torchrun or as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MNIST_ROOT = ROOT.parent / "shared" / "data" / "mnist10k"

needs_mnist = pytest.mark.skipif(
    not (MNIST_ROOT / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file(),
    reason=f"real MNIST digits not found at {MNIST_ROOT} (only in the project's workspace)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run_script(
    script: str,
    *args: str,
    nproc: int | None = None,
    timeout: float = 300,
    check: bool = True,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess:
    """``python SCRIPT args`` (nproc=None) or ``torchrun --standalone --nproc_per_node=N``."""
    script = str(ROOT / script)
    if nproc is None:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", script, *args,
        ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
