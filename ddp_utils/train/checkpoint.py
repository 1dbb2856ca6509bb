"""Checkpoints: written atomically by the main rank, loaded safely (weights only)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_utils.config import ConfigError
from ddp_utils.dist import Runtime, barrier
from ddp_utils.files import atomic_save, atomic_write


def publish(src: Path, dst: Path) -> None:
    """Make ``dst`` name the same complete file as ``src``, atomically (a hard link, or a copy
    where the filesystem has none)."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")  # unique per writer
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        atomic_write(tmp, lambda f: f.write(src.read_bytes()))
    os.replace(tmp, dst)


def step_checkpoints(ckpt_dir: Path) -> list[Path]:
    """``step_*.pt`` files, oldest first."""
    return sorted(ckpt_dir.glob("step_*.pt"))


def save_training_checkpoint(
    state: dict[str, Any], ckpt_dir: Path, also: tuple[str, ...], keep_last: int, rt: Runtime
) -> Path:
    """Main rank: write ``step_<N>.pt``, point ``last.pt`` (and each name in ``also``, such as
    ``best.pt``) at it, drop all but the newest ``keep_last`` step files. Every rank waits
    until that is done."""
    path = ckpt_dir / f"step_{state['step']:08d}.pt"
    if rt.is_main:
        atomic_save(state, path)
        for name in ("last.pt", *also):
            publish(path, ckpt_dir / name)
        for old in step_checkpoints(ckpt_dir)[:-keep_last]:
            old.unlink()
    barrier()
    return path


def newest_loadable(
    ckpt_dir: Path, warn: Callable[[str], None]
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``ckpt_dir`` that loads, with its contents; torn ones are
    skipped with a warning. An unsafe file is not skipped: it raises, since someone put it
    there."""
    candidates = list(reversed(step_checkpoints(ckpt_dir)))
    if not candidates and (ckpt_dir / "last.pt").is_file():
        candidates = [ckpt_dir / "last.pt"]
    for path in candidates:
        try:
            return path, load_checkpoint(path)
        except CorruptCheckpointError as e:
            warn(f"skipping a checkpoint that does not load: {e}")
    return None


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


class CorruptCheckpointError(ConfigError):
    """A checkpoint that is torn or unreadable (as opposed to unsafe or missing)."""


def _corrupt(path: Path, e: BaseException) -> ConfigError:
    return CorruptCheckpointError(
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
