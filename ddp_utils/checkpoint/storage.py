"""Where a checkpoint's bytes go: today a local folder (``run_dir/checkpoints``).

Everything that names, publishes, lists or removes a checkpoint in its folder is here, so a
backend of another kind (an fsspec URL, an object store) replaces this module's functions and
nothing else. A checkpoint is complete when its name is ``step_<N>.pt`` or ``step_<N>.dcp``:
it is written under a hidden temporary name and renamed whole; ``last`` points at the newest,
``best`` is a copy of its own, and only the newest ``trainer.keep_last`` step checkpoints stay.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddp_utils.files import atomic_write

SHARDED_SUFFIX = ".dcp"  # a folder of torch.distributed.checkpoint shards
SUFFIXES = (".pt", SHARDED_SUFFIX)


def checkpoint_dir(run_dir: Path) -> Path:
    """The run's checkpoint folder."""
    return run_dir / "checkpoints"


def step_path(ckpt_dir: Path, step: int, suffix: str) -> Path:
    return ckpt_dir / f"step_{step:08d}{suffix}"


def step_checkpoints(ckpt_dir: Path) -> list[Path]:
    """``step_*.pt`` files and ``step_*.dcp`` folders, oldest first."""
    return sorted(p for p in ckpt_dir.glob("step_*") if p.suffix in SUFFIXES)


def last_checkpoints(ckpt_dir: Path) -> list[Path]:
    """``last.pt`` and ``last.dcp``, those that exist."""
    return [p for p in (ckpt_dir / f"last{s}" for s in SUFFIXES) if p.exists()]


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


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
