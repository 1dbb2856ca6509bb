"""Faults made for real: a small tmpfs, a checkpoint whose unpickling would run code."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    """A real tmpfs of ``size`` mounted at ``where`` for the block (the test skips where this
    process may not mount one), unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or 'not root'}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_malicious_checkpoint(path: Path, marker: Path) -> Path:
    """A .pt whose unpickling would run ``touch marker``: loading it must be refused."""
    path.write_bytes(pickle.dumps({"model": _RunsCode(marker), "config": {}}))
    return path
