"""The checkpoint format, in one place: written atomically (``step_<N>.pt``, ``last.pt`` and
``best.pt`` published from it), loaded safely (weights only, a torn file named), and turned
back into a model for eval.py and generate.py (``inference_model``). A training checkpoint is a
dict of plain tensors and containers: ``model``, ``optimizer``, ``scheduler``, ``scaler``,
``strategy`` (its own state: PowerSGD's), ``epoch``, ``step``, ``sample_offset``,
``epoch_totals``, ``sampler``, ``rng`` (every rank's), ``best``, ``best_ema``, ``model_ema``
(with EMA), ``world_size``, ``classes``, ``samples_seen``, ``trackers``, ``config`` (the run's
whole config), and what the data adds for inference (``tokenizer``).

A sharded checkpoint (``trainer.strategy=fsdp2``) is a folder ``step_<N>.dcp/`` written by
every rank with torch.distributed.checkpoint: ``model``, ``optimizer`` and ``model_ema`` as
shards (``.metadata`` and one ``.distcp`` file a rank), the rest in ``meta.pt`` (the main
rank's, read with ``weights_only``). It is written as ``.step_<N>.dcp.tmp/`` and renamed
whole, so a folder named ``step_*`` is complete; ``last.dcp`` is a link to the newest,
``best.dcp`` a copy of its own. Any world size reads it (resharded to its own);
``python -m ddp_utils.checkpoint DIR OUT.pt`` turns it into one whole file."""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_utils.config import ConfigError, TrainConfig, whole_sentences
from ddp_utils.dist import Runtime, checkpoint_group
from ddp_utils.files import atomic_save, atomic_write, writing_into
from ddp_utils.models import build_model
from ddp_utils.run import write_on_main


def publish(src: Path, dst: Path, copy: bool = False) -> None:
    """Make ``dst`` hold the same complete file as ``src``, atomically: a hard link (the same
    file), or with ``copy`` (or where the filesystem has no links) a file of its own. A
    sharded checkpoint's folder gets a symbolic link, or a copied folder swapped in."""
    if src.is_dir():
        (copy_folder if copy else link)(src, dst)
        return
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


SHARDED_SUFFIX = ".dcp"
SHARDED_KEYS = ("model", "optimizer", "model_ema")  # the states a sharded checkpoint shards
META = "meta.pt"  # a sharded checkpoint's plain part


def step_checkpoints(ckpt_dir: Path) -> list[Path]:
    """``step_*.pt`` files and ``step_*.dcp`` folders, oldest first."""
    return sorted(p for p in ckpt_dir.glob("step_*") if p.suffix in (".pt", SHARDED_SUFFIX))


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


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
        publish_step(path, ckpt_dir, also, keep_last)

    write_on_main(ckpt_dir.parent, rt, write)  # every rank waits for it, or stops with it
    return path


def publish_step(path: Path, ckpt_dir: Path, also: tuple[str, ...], keep_last: int) -> None:
    """After a complete step checkpoint ``path`` (a file or a sharded folder): ``last`` points
    at it, each name in ``also`` (``best.pt``; ``best.dcp`` for a folder) gets a copy of its
    own, and all but the newest ``keep_last`` step checkpoints go."""
    publish(path, ckpt_dir / f"last{path.suffix}")
    for name in also:
        publish(path, ckpt_dir / Path(name).with_suffix(path.suffix).name, copy=True)
    for old in step_checkpoints(ckpt_dir)[:-keep_last]:
        remove(old)


def link(target: Path, name: Path) -> None:
    """Point the symbolic link ``name`` at ``target`` (a sibling), atomically."""
    tmp = name.with_name(f".{name.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, name)


def copy_folder(src: Path, dst: Path) -> None:
    """``dst`` becomes a complete copy of ``src``: copied beside it, then swapped in."""
    tmp, old = (dst.with_name(f".{dst.name}.{os.getpid()}.{t}") for t in ("tmp", "old"))
    for p in (tmp, old):
        remove(p)
    shutil.copytree(src, tmp)
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    remove(old)


@contextmanager
def removed_on_failure(folder: Path, owner: bool = True) -> Iterator[None]:
    """Nothing partial left behind: ``folder`` goes (by its ``owner``) if the block fails."""
    try:
        yield
    except BaseException:
        if owner:
            shutil.rmtree(folder, ignore_errors=True)
        raise


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

    path = ckpt_dir / f"step_{state['step']:08d}{SHARDED_SUFFIX}"
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
        candidates = [p for p in (ckpt_dir / "last.pt", ckpt_dir / "last.dcp") if p.exists()]
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


def model_weights(
    ckpt: dict[str, Any], checkpoint: str | Path, ema: bool, model: nn.Module
) -> dict[str, Any]:
    """The checkpoint's model weights, or with ``ema=true`` its EMA weights (a sharded
    checkpoint's read whole, in the shapes of ``model``'s state dict)."""
    if SHARDED_DIR in ckpt:
        if ema and "model_ema" not in ckpt["sharded"]:
            raise ConfigError(f"ema=true but checkpoint={checkpoint} holds no EMA weights: "
                              "train with trainer.ema_decay, or drop ema=true.")  # fmt: skip
        template = {"model": model.state_dict()}
        read_sharded(ckpt, {"model_ema": template} if ema else template, alone=True)
        return template["model"]
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
    weights = model_weights(ckpt, checkpoint, ema, model)
    load_model_state(model, weights, f"checkpoint={checkpoint}", fix)
    return model


def to_single_file(src: Path, dst: Path) -> None:
    """A sharded checkpoint as one whole file that eval.py and generate.py read, and that can
    be shared: torch's ``dcp_to_torch_save`` gathers the shards; the optimizer's state stays
    behind (keyed by parameter name, it would not load into a single process's optimizer, and
    training resumes from the folder)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = load_sharded_meta(src)
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        dcp_to_torch_save(src, Path(tmp) / "whole.pt")
        whole = torch.load(Path(tmp) / "whole.pt", map_location="cpu", weights_only=True)
    plain = {k: v for k, v in meta.items() if k not in (SHARDED_DIR, "sharded")}
    states = {k: v for k, v in whole.items() if k != "optimizer"}
    atomic_save(plain | states | {"converted_from": str(src)}, dst)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m ddp_utils.checkpoint",
        description="Turn a sharded checkpoint folder (trainer.strategy=fsdp2, *.dcp) into one "
        "whole .pt file for eval.py, generate.py and sharing.",
    )
    p.add_argument("src", type=Path, help="a .dcp folder, e.g. outputs/RUN/checkpoints/best.dcp")
    p.add_argument("dst", type=Path, help="the .pt file to write")
    args = p.parse_args(argv)
    try:
        to_single_file(args.src, args.dst)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
