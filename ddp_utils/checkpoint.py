"""The checkpoint format, in one place: written atomically (``step_<N>.pt``, ``last.pt`` and
``best.pt`` published from it), loaded safely (weights only, a torn file named), and turned
back into a model for eval.py and generate.py (``inference_model``).

A training checkpoint is a dict of plain tensors and containers: ``model``, ``optimizer``,
``scheduler``, ``scaler``, ``epoch``, ``step``, ``sample_offset``, ``epoch_totals``,
``sampler``, ``rng`` (every rank's), ``best``, ``best_ema``, ``model_ema`` (with EMA),
``world_size``, ``classes``, ``samples_seen``, ``trackers``, ``config`` (the run's whole
config), and what the data adds for inference (``tokenizer``)."""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_utils.config import ConfigError, TrainConfig, whole_sentences
from ddp_utils.dist import Runtime
from ddp_utils.files import atomic_save, atomic_write
from ddp_utils.models import build_model
from ddp_utils.run import write_on_main


def publish(src: Path, dst: Path, copy: bool = False) -> None:
    """Make ``dst`` hold the same complete file as ``src``, atomically: a hard link (the same
    file), or with ``copy`` (or where the filesystem has no links) a file of its own."""
    if copy:
        with open(src, "rb") as f:
            atomic_write(dst, lambda out: shutil.copyfileobj(f, out, 1 << 22))
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")  # unique per writer
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        publish(src, dst, copy=True)
        return
    os.replace(tmp, dst)


def step_checkpoints(ckpt_dir: Path) -> list[Path]:
    """``step_*.pt`` files, oldest first."""
    return sorted(ckpt_dir.glob("step_*.pt"))


def save_training_checkpoint(
    state: dict[str, Any], ckpt_dir: Path, also: tuple[str, ...], keep_last: int, rt: Runtime
) -> Path:
    """Main rank: write ``step_<N>.pt``, point ``last.pt`` at it (a hard link: the newest step
    file, which resume reads first, is the same file), copy it to each name in ``also`` (such
    as ``best.pt``: a file of its own, so damage to last.pt or a step file leaves it whole),
    drop all but the newest ``keep_last`` step files. Every rank waits until that is done."""
    path = ckpt_dir / f"step_{state['step']:08d}.pt"

    def write() -> None:
        atomic_save(state, path)
        publish(path, ckpt_dir / "last.pt")
        for name in also:
            publish(path, ckpt_dir / name, copy=True)
        for old in step_checkpoints(ckpt_dir)[:-keep_last]:
            old.unlink()

    write_on_main(ckpt_dir.parent, rt, write)  # every rank waits for it, or stops with it
    return path


def newest_loadable(
    ckpt_dir: Path, warn: Callable[[str], None]
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``ckpt_dir`` that loads, with its contents; a torn one is
    skipped with a warning. None when there is none at all; when there are some but none
    loads, ConfigError with what was tried (training over the run would lose it). An unsafe
    file is not skipped: it raises, since someone put it there."""
    candidates = list(reversed(step_checkpoints(ckpt_dir)))
    if not candidates and (ckpt_dir / "last.pt").is_file():
        candidates = [ckpt_dir / "last.pt"]
    tried = []
    for path in candidates:
        try:
            return path, load_checkpoint(path)
        except CorruptCheckpointError as e:
            warn(f"skipping a checkpoint that does not load: {e}")
            tried.append(f"{path.name} ({e.reason})")
    if not tried:
        return None
    others = sorted(p.name for p in ckpt_dir.glob("*.pt") if p not in candidates)
    also = f" Other files there: {', '.join(others)}." if others else ""
    raise ConfigError(
        f"resume=auto found checkpoints in {ckpt_dir} but none loads: {'; '.join(tried)}.{also} "
        "Nothing was trained over them. Resume from a file you trust with resume=PATH, or "
        "start a new run with resume=never and another run_dir=PATH."
    )


def _summary(e: BaseException) -> str:
    """What went wrong: the first line of the error, in whole sentences, else its type."""
    text = str(e).strip()
    return whole_sentences(text.splitlines()[0] if text else "") or type(e).__name__


def _blocked_global(e: BaseException) -> str:
    for line in str(e).splitlines():
        if "Unsupported global" in line or "GLOBAL" in line:
            return whole_sentences(line.strip()) or "an unsupported global"
    return _summary(e)


def load_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Load with ``weights_only=True``; a missing, corrupt or unsafe file raises ConfigError.
    ``mmap``: map the tensors instead of reading them (to look at the config alone)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"checkpoint={path}: no such file; pass the path of a .pt file written by train.py "
            "(e.g. outputs/<run>/checkpoints/best.pt)."
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
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

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _corrupt(path: Path, e: BaseException) -> ConfigError:
    reason = _summary(e)
    return CorruptCheckpointError(
        f"checkpoint={path} is corrupt or truncated ({reason}). Use another checkpoint of the "
        "run (last.pt, best.pt) or train again.",
        reason,
    )


def load_model_state(model: nn.Module, state: dict[str, Any], where: str, fix: str) -> None:
    """Load a state dict, turning a shape or key mismatch into a message the user can act on."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        detail = (whole_sentences(lines[0]) if lines else "") or _summary(e)
        raise ConfigError(
            f"{where} does not fit the model built from the config ({detail}). {fix}"
        ) from None


def model_weights(ckpt: dict[str, Any], checkpoint: str | Path, ema: bool) -> dict[str, Any]:
    """The checkpoint's model weights, or with ``ema=true`` its EMA weights."""
    if not ema:
        return ckpt["model"]
    if "model_ema" not in ckpt:
        raise ConfigError(
            f"ema=true but checkpoint={checkpoint} holds no EMA weights: train with "
            "trainer.ema_decay=0.9999 (for example), or drop ema=true."
        )
    return ckpt["model_ema"]["model"]


def inference_model(
    ckpt: dict[str, Any],
    checkpoint: str | Path,
    train_cfg: TrainConfig,
    ema: bool,
    num_outputs: int | None = None,
    fix: str = "Give a train.py checkpoint.",
) -> nn.Module:
    """The model ``train_cfg`` describes, with the checkpoint's weights (its EMA weights with
    ``ema``), on the CPU; ``fix`` is what to do when they do not fit."""
    model = build_model(train_cfg.model, train_cfg.data, num_outputs)
    load_model_state(model, model_weights(ckpt, checkpoint, ema), f"checkpoint={checkpoint}", fix)
    return model
