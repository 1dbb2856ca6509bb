"""Where a checkpoint's bytes go: a local folder (``run_dir/checkpoints`` unless
``trainer.checkpoint.dir`` names another) or any fsspec URL (``s3://bucket/prefix``).

Both hold ``step_<N>.pt`` files (one whole checkpoint, written by the main rank) and
``step_<N>.dcp/`` folders (shards, written by every rank). What makes one complete differs:

- A local folder renames: a file or folder is written under a hidden temporary name and
  renamed whole. ``last.pt`` is a hard link to the newest step file (``last.dcp`` a symbolic
  link), ``best.pt`` a copy of its own.
- An object store has no rename. A step counts only once its commit marker
  (``step_<N>.pt.complete``, a small JSON written after every byte of it) exists; ``last``,
  ``best`` and ``best_ema`` are markers (``last.json``, ...) that name a step, not copies. A
  step without its marker (a save killed halfway, or the store lost during it) is never read,
  and the next commit removes it.

Either way only the newest ``trainer.keep_last`` steps stay, and on a store those a ``best``
marker names besides.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

import torch

from ddp_utils.config import ConfigError
from ddp_utils.files import atomic_save, atomic_write
from ddp_utils.urls import fs_options, is_url, local_path

SHARDED_SUFFIX = ".dcp"  # a folder of torch.distributed.checkpoint shards
SUFFIXES = (".pt", SHARDED_SUFFIX)
META = "meta.pt"  # a sharded checkpoint's plain part
COMMIT = ".complete"  # on a store: the marker that makes a step count
STEP = re.compile(r"^step_(\d+)(\.pt|\.dcp)$")
UPLOAD_PART = 16 << 20  # a multipart upload's part size (s3fs uploads 10 at a time)


def step_name(step: int, suffix: str) -> str:
    return f"step_{step:08d}{suffix}"


def marker_name(name: str) -> str:
    """``best.pt`` -> ``best.json``: the store's marker for a name local folders give a file."""
    return f"{name.split('.')[0]}.json"


class Storage:
    """A checkpoint folder: where each step goes, what is complete, how it is read back.
    ``where`` is its path or URL as the user gave it."""

    where: str
    is_local: bool

    def ref(self, name: str) -> str:
        """A checkpoint's path or URL, as messages and ``resume=`` give it."""
        return f"{self.where.rstrip('/')}/{name}"

    # -- writing (the main rank, except the shards) ----------------------------------------
    def write_file(self, name: str, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def begin_sharded(self, name: str) -> None:
        """Before any rank writes ``name``'s shards: nothing stale where they go."""
        raise NotImplementedError

    def shard_writer(self, name: str) -> Any:
        """The DCP storage writer for ``name``'s shards (every rank)."""
        raise NotImplementedError

    def commit(self, name: str, plain: dict[str, Any] | None, also: tuple[str, ...],
               keep_last: int) -> None:  # fmt: skip
        """Make ``name`` complete (a sharded one with its ``plain`` part), make ``last`` and
        each name in ``also`` (``best.pt``) name it, drop all but the newest ``keep_last``."""
        raise NotImplementedError

    def abandon(self, name: str) -> None:
        """Remove what a failed save left of ``name`` (best effort: the store may be down)."""
        raise NotImplementedError

    # -- reading ---------------------------------------------------------------------------
    def complete(self) -> list[str]:
        """The names of the complete checkpoints, newest first."""
        raise NotImplementedError

    def holds_any(self) -> bool:
        """Whether any checkpoint, complete or not, is there."""
        raise NotImplementedError

    def shard_reader(self, name: str) -> Any:
        raise NotImplementedError


class LocalFolder(Storage):
    """A folder on a local or shared file system; completeness by rename."""

    is_local = True

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.where = str(self.folder)

    def ref(self, name: str) -> str:
        return str(self.folder / name)

    def write_file(self, name: str, state: dict[str, Any]) -> None:
        atomic_save(state, self.folder / name)

    def _tmp(self, name: str) -> Path:
        return self.folder / f".{name}.tmp"

    def begin_sharded(self, name: str) -> None:
        remove(self._tmp(name))
        self._tmp(name).mkdir(parents=True)

    def shard_writer(self, name: str) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(self._tmp(name))

    def shard_reader(self, name: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(name)

    def commit(self, name: str, plain: dict[str, Any] | None, also: tuple[str, ...],
               keep_last: int) -> None:  # fmt: skip
        path = self.folder / name
        if plain is not None:
            tmp = self._tmp(name)
            with removed_on_failure(tmp):
                atomic_save(plain, tmp / META)
            remove(path)
            os.replace(tmp, path)
        publish_step(path, self.folder, also, keep_last)

    def abandon(self, name: str) -> None:
        remove(self._tmp(name))

    def complete(self) -> list[str]:
        found = [p.name for p in reversed(step_checkpoints(self.folder))]
        return found or [p.name for p in last_checkpoints(self.folder)]

    def holds_any(self) -> bool:
        return bool(step_checkpoints(self.folder)) or (self.folder / "last.pt").exists()


class ObjectStore(Storage):
    """A folder at an fsspec URL (an object store): completeness by a marker written last."""

    is_local = False

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        import fsspec

        self.where = url.rstrip("/")
        self.options = fs_options(url, storage_options)
        try:
            self.fs, self.base = fsspec.core.url_to_fs(self.where, **self.options)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"trainer.checkpoint.dir={url}: {e} (S3 needs s3fs: pip install "
                              "s3fs; GCS gcsfs).") from None  # fmt: skip
        self.base = self.base.rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.base}/{name}"

    def write_file(self, name: str, state: dict[str, Any]) -> None:
        """Serialised to a local temporary file, then uploaded in parts side by side (what
        ``aws s3 cp`` does; part by part as torch.save writes took 1.8 times as long), never
        the whole in memory."""
        with tempfile.TemporaryDirectory(prefix="ddp-recipes-upload-") as tmp:
            local = Path(tmp) / "checkpoint.pt"
            torch.save(state, local)
            self.upload(local, name)

    def upload(self, local: Path, name: str) -> None:
        """A local file to ``name``: on S3 a multipart upload, its parts side by side."""
        parts = {"chunksize": UPLOAD_PART} if "s3" in self.fs.protocol else {}
        self.fs.put_file(str(local), self._path(name), **parts)

    def write_json(self, name: str, record: dict[str, Any]) -> None:
        self.fs.pipe_file(self._path(name), json.dumps(record).encode())

    def read_json(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(self._path(name)))
        except FileNotFoundError:
            return None

    def begin_sharded(self, name: str) -> None:
        self.abandon(name)

    def shard_writer(self, name: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # No rename on a store: each rank's file and .metadata go straight to their names
        return FsspecWriter(self.ref(name), sync_files=False, **self.options)

    def shard_reader(self, name: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(name, **self.options)

    def commit(self, name: str, plain: dict[str, Any] | None, also: tuple[str, ...],
               keep_last: int) -> None:  # fmt: skip
        if plain is not None:
            self.write_file(f"{name}/{META}", plain)
        step = int(STEP.match(name).group(1))  # type: ignore[union-attr]
        record = {"step": step, "name": name, "time": time.time()}
        self.write_json(name + COMMIT, record)  # from here on the step counts
        for marker in ("last.pt", *also):
            self.write_json(marker_name(marker), record)
        self.retain(keep_last)

    def named(self) -> set[str]:
        """The steps a marker names (``best``, ``best_ema``, ``last``): kept past keep_last."""
        names = set()
        for info in self.fs.ls(self.base, detail=True):
            base = info["name"].rsplit("/", 1)[-1]
            if base.endswith(".json") and not base.startswith("step_"):
                record = self.read_json(base)
                if record and "name" in record:
                    names.add(record["name"])
        return names

    def retain(self, keep_last: int) -> None:
        """All but the newest ``keep_last`` complete steps go (marker first, so a removal cut
        short leaves an incomplete step, never a complete one with missing parts), and so
        does every incomplete step older than the newest complete one."""
        done = self.complete()
        keep = set(done[:keep_last]) | self.named()
        newest = STEP.match(done[0]).group(1) if done else ""  # type: ignore[union-attr]
        for name in self.steps():
            committed = name in done
            if name in keep or (not committed and STEP.match(name).group(1) >= newest):  # type: ignore[union-attr]
                continue
            if committed:
                self.fs.rm(self._path(name + COMMIT))
            self.remove(name)

    def remove(self, name: str) -> None:
        with suppress(FileNotFoundError):
            self.fs.rm(self._path(name), recursive=True)

    def abandon(self, name: str) -> None:
        # The store may be what failed: a step left without its marker is ignored by name
        with suppress(Exception):
            self.remove(name)

    def listing(self) -> set[str]:
        """The names in the folder, fresh from the store (never a cached listing)."""
        try:
            entries = self.fs.ls(self.base, detail=False, refresh=True)
        except FileNotFoundError:
            return set()
        return {e.rstrip("/").rsplit("/", 1)[-1] for e in entries}

    def steps(self) -> list[str]:
        """Every ``step_<N>.pt`` / ``step_<N>.dcp`` there, complete or not, oldest first."""
        return sorted(n for n in self.listing() if STEP.match(n))

    def complete(self) -> list[str]:
        names = self.listing()
        return sorted((n for n in names if STEP.match(n) and n + COMMIT in names), reverse=True)

    def holds_any(self) -> bool:
        return bool(self.steps())

    def resolve(self, name: str) -> str:
        """A step's name for ``name``: itself, or the step a marker (``last.pt``,
        ``best.dcp``, ``best.json``) names."""
        if STEP.match(name):
            return name
        record = self.read_json(marker_name(name))
        if record is None:
            raise ConfigError(f"checkpoint={self.ref(name)}: no such checkpoint (and no "
                              f"{marker_name(name)} marker there).")  # fmt: skip
        return record["name"]

    def open(self, name: str) -> IO[bytes]:
        """A whole step file's bytes, read into memory."""
        return io.BytesIO(self.fs.cat_file(self._path(name)))

    def is_complete(self, name: str) -> bool:
        return self.fs.exists(self._path(name + COMMIT))


def open_storage(where: str | Path, storage_options: dict[str, Any] | None = None) -> Storage:
    """The checkpoint folder at ``where``: a local folder, or an fsspec URL."""
    if is_url(where):
        return ObjectStore(str(where), dict(storage_options or {}))
    return LocalFolder(Path(local_path(str(where))))


def run_storage(options: Any, run_dir: Path) -> Storage:
    """``trainer.checkpoint.dir`` (``options``), or the run's own ``run_dir/checkpoints``."""
    return open_storage(options.dir or checkpoint_dir(run_dir), options.storage_options)


def checkpoint_dir(run_dir: Path) -> Path:
    """The run's checkpoint folder."""
    return run_dir / "checkpoints"


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
