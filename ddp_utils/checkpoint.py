"""Checkpoints: atomic writes from the main rank, and safe (weights-only) loading."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from ddp_utils.config import ConfigError
from ddp_utils.dist import Runtime, barrier


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write to a temporary file in the same folder, fsync it, then rename over ``path``.

    A reader (or a restart) sees either the old file or the complete new one, never a torn one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def save_on_main(obj: dict[str, Any], paths: list[Path], rt: Runtime) -> None:
    """The main rank writes ``obj`` to each path; every rank waits until the files exist."""
    if rt.is_main:
        for path in paths:
            atomic_save(obj, path)
    barrier()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _blocked_global(e: BaseException) -> str:
    for line in str(e).splitlines():
        if "Unsupported global" in line or "GLOBAL" in line:
            return line.strip()[:200]
    return _first_line(e)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load with ``weights_only=True``; a missing, corrupt or unsafe file raises ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"checkpoint={path}: no such file; pass the path of a .pt file written by train.py "
            "(e.g. outputs/<run>/checkpoints/best.pt)."
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            # Never retried with weights_only=False: that would run whatever the file holds.
            raise ConfigError(
                f"checkpoint={path} refused: loading it would need arbitrary unpickling "
                f"({_blocked_global(e)}), which can run code. Load only checkpoints written "
                "by train.py."
            ) from None
        raise _corrupt(path, e) from None
    except Exception as e:  # torch.load reports torn files as RuntimeError, KeyError, EOFError...
        raise _corrupt(path, e) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise ConfigError(f"checkpoint={path} was not written by train.py (no model/config keys).")
    return ckpt


def _corrupt(path: Path, e: BaseException) -> ConfigError:
    return ConfigError(
        f"checkpoint={path} is corrupt or truncated ({_first_line(e)}); use another "
        "checkpoint of the run (last.pt, best.pt) or train again."
    )


def load_model_state(model: nn.Module, state: dict[str, Any], where: str, fix: str) -> None:
    """Load a state dict, turning a shape or key mismatch into a message the user can act on."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        detail = (lines[0] if lines else _first_line(e))[:240]
        raise ConfigError(
            f"{where} does not fit the model built from the config ({detail}). {fix}"
        ) from None
