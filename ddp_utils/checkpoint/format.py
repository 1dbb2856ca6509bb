"""What a checkpoint is on disk, and how it is read back: one whole file (``step_<N>.pt``,
written by the main rank) or, when the strategy shards parameters, a folder
(``step_<N>.dcp/``, written by every rank with torch.distributed.checkpoint). Loaded safely
(weights only, a torn file named).

A training checkpoint is a dict of plain tensors and containers: ``model``, ``optimizer``,
``scheduler``, ``scaler``, ``strategy`` (its own state: PowerSGD's), ``epoch``, ``step``,
``sample_offset``, ``epoch_totals``, ``sampler``, ``rng`` (every rank's), ``best``,
``best_ema``, ``model_ema`` (with EMA), ``world_size``, ``classes``, ``samples_seen``,
``trackers``, ``config`` (the run's whole config), and what the data adds for inference
(``tokenizer``).

A sharded checkpoint holds ``model``, ``optimizer`` and ``model_ema`` as shards
(``.metadata`` and one ``.distcp`` file a rank), the rest in ``meta.pt`` (the main rank's,
read with ``weights_only``). It is written as ``.step_<N>.dcp.tmp/`` and renamed whole; any
world size reads it (resharded to its own); ``python -m ddp_utils.checkpoint DIR OUT.pt``
turns it into one whole file."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp_utils.checkpoint.storage import (
    SHARDED_SUFFIX,
    last_checkpoints,
    publish_step,
    remove,
    removed_on_failure,
    step_checkpoints,
    step_path,
)
from ddp_utils.config import ConfigError, UserError, whole_sentences
from ddp_utils.dist import Runtime, checkpoint_group
from ddp_utils.files import atomic_save
from ddp_utils.lifecycle.disk import writing_into
from ddp_utils.run.folder import write_on_main

SHARDED_KEYS = ("model", "optimizer", "model_ema")  # the states a sharded checkpoint shards
META = "meta.pt"  # a sharded checkpoint's plain part


def save_whole(
    state: dict[str, Any], ckpt_dir: Path, also: tuple[str, ...], keep_last: int, rt: Runtime
) -> Path:
    """Main rank: write ``step_<N>.pt``, point ``last.pt`` at it (a hard link: the newest step
    file, which resume reads first, is the same file), copy it to each name in ``also`` (such
    as ``best.pt``: a file of its own, so damage to last.pt or a step file leaves it whole),
    drop all but the newest ``keep_last`` step files. Every rank waits until that is done."""
    path = step_path(ckpt_dir, state["step"], ".pt")

    def write_file() -> None:
        atomic_save(state, path)
        publish_step(path, ckpt_dir, also, keep_last)

    write_on_main(ckpt_dir.parent, rt, write_file)  # every rank waits for it, or stops with it
    return path


def save_sharded(
    state: dict[str, Any],
    ckpt_dir: Path,
    also: tuple[str, ...],
    keep_last: int,
    rt: Runtime,
    timeout_s: float = 1800.0,
) -> Path:
    """Every rank: write its shards of ``state``'s model, optimizer and EMA (and the main rank
    the rest) into ``step_<N>.dcp/``, renamed into place once complete; ``last.dcp`` then links
    to it, each name in ``also`` (``best.pt`` is ``best.dcp``) gets a copy, and all but the
    newest ``keep_last`` step folders go. DCP's collectives wait ``timeout_s`` for the
    slowest rank's write (``trainer.checkpoint.timeout_s``), not the training group's timeout."""
    import torch.distributed.checkpoint as dcp

    path = step_path(ckpt_dir, state["step"], SHARDED_SUFFIX)
    tmp = ckpt_dir / f".{path.name}.tmp"
    write_on_main(ckpt_dir.parent, rt, lambda: (remove(tmp), tmp.mkdir(parents=True)))
    shards = {k: state[k] for k in SHARDED_KEYS if k in state}
    with removed_on_failure(tmp, rt.is_main), writing_into(ckpt_dir.parent):
        # every rank its own file; raises on every rank
        dcp.save(shards, checkpoint_id=tmp, process_group=checkpoint_group(timeout_s))

    def publish_folder() -> None:
        plain = {k: v for k, v in state.items() if k not in shards}
        with removed_on_failure(tmp):
            atomic_save(plain | {"sharded": sorted(shards)}, tmp / META)
        remove(path)
        os.replace(tmp, path)
        publish_step(path, ckpt_dir, also, keep_last)

    write_on_main(ckpt_dir.parent, rt, publish_folder)
    return path


def read_sharded(ckpt: dict[str, Any], template: dict[str, Any], alone: bool = False) -> None:
    """Fill ``template`` (state dicts as the reader holds them: shards of its own world size,
    or whole tensors) from a sharded checkpoint. Every rank calls it, unless ``alone``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(template, checkpoint_id=ckpt[SHARDED_DIR], no_dist=alone)


def newest_loadable(
    ckpt_dir: Path, warn: Callable[[str], None]
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``ckpt_dir`` that loads, with its contents; a torn one is
    skipped with a warning. None when there is none at all; when there are some but none
    loads, ConfigError with what was tried (training over the run would lose it). An unsafe
    file is not skipped: it raises, since someone put it there."""
    candidates = list(reversed(step_checkpoints(ckpt_dir)))
    if not candidates:
        candidates = last_checkpoints(ckpt_dir)
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


def summary(e: BaseException) -> str:
    """What went wrong: the first line of the error, in whole sentences, else its type."""
    text = str(e).strip()
    return whole_sentences(text.splitlines()[0] if text else "") or type(e).__name__


def _blocked_global(e: BaseException) -> str:
    for line in str(e).splitlines():
        if "Unsupported global" in line or "GLOBAL" in line:
            return whole_sentences(line.strip()) or "an unsupported global"
    return summary(e)


def load_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Load with ``weights_only=True``; a missing, corrupt or unsafe file raises ConfigError.
    ``mmap``: map the tensors instead of reading them (to look at the config alone)."""
    path = Path(path)
    if path.is_dir():
        return load_sharded_meta(path)
    if not path.is_file():
        raise ConfigError(
            f"checkpoint={path}: no such file; pass the path of a .pt file (or .dcp folder) "
            "written by train.py (e.g. outputs/<run>/checkpoints/best.pt)."
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
    if (
        not isinstance(ckpt, dict)
        or "config" not in ckpt
        or not ("model" in ckpt or "sharded" in ckpt)
    ):
        raise ConfigError(f"checkpoint={path} was not written by train.py (no model/config keys).")
    return ckpt


SHARDED_DIR = "sharded_dir"  # where a loaded sharded checkpoint's shards are


def load_sharded_meta(path: Path) -> dict[str, Any]:
    """A sharded checkpoint's plain part, with where its shards are (``SHARDED_DIR``)."""
    for part in (".metadata", META):
        if not (path / part).is_file():
            raise _corrupt(path, FileNotFoundError(f"no {part} in {path.name}"))
    return load_checkpoint(path / META) | {SHARDED_DIR: str(path)}


class CorruptCheckpointError(UserError):
    """A checkpoint that is torn or unreadable (as opposed to unsafe or missing)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _corrupt(path: Path, e: BaseException) -> ConfigError:
    reason = summary(e)
    return CorruptCheckpointError(
        f"checkpoint={path} is corrupt or truncated ({reason}). Use another checkpoint of the "
        "run (last.pt, best.pt) or train again.",
        reason,
    )


def write(
    state: dict[str, Any],
    ckpt_dir: Path,
    also: tuple[str, ...],
    keep_last: int,
    rt: Runtime,
    sharded: bool,
    timeout_s: float,
) -> Path:
    """Every rank: write ``state`` as a sharded folder when the strategy shards parameters
    (``sharded``), else as one whole file from the main rank; return its path."""
    if sharded:
        return save_sharded(state, ckpt_dir, also, keep_last, rt, timeout_s)
    return save_whole(state, ckpt_dir, also, keep_last, rt)


def read_states(ckpt: dict[str, Any], templates: Callable[[], dict[str, Any]],
                shards_parameters: bool) -> dict[str, Any]:  # fmt: skip
    """The checkpoint's ``model``, ``optimizer`` and ``model_ema`` states as the strategy loads
    them: a whole file's as they are; a sharded folder's read into ``templates()`` (this run's
    own state dicts, resharded to this world size). Every rank calls it."""
    if SHARDED_DIR not in ckpt:
        return ckpt
    if not shards_parameters:
        raise ConfigError(
            f"{ckpt[SHARDED_DIR]} is a sharded checkpoint: resume it with the strategy "
            f"that wrote it (trainer.strategy={ckpt['config']['trainer']['strategy']})."
        )
    template = {k: v for k, v in templates().items() if k != "model_ema" or k in ckpt["sharded"]}
    read_sharded(ckpt, template)
    return template
