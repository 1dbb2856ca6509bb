"""Atomic file writes: a reader, or a restart, sees the old file or the whole new one."""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ddp_utils.lifecycle.disk import unwritable_cause


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write to a temporary file in the same folder, fsync it, then rename over ``path``.

    A reader (or a restart) sees either the old file or the complete new one, never a torn one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per writer: two writers of one path never share (or delete) a temporary file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        if (cause := unwritable_cause(e)) is not None:
            cause.filename = str(path)  # the file meant, not the temporary one
            raise cause from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_save(obj: Any, path: Path) -> None:
    import torch  # here: the plotting command line writes files without loading torch

    atomic_write(path, lambda f: torch.save(obj, f))


def made_once(path: Path, make: Callable[[Path], Any]) -> Path:
    """``path`` (a file or a folder), made by one process of the node while the others wait
    on a lock beside it. ``make`` writes a temporary path that is renamed into place whole:
    a reader never sees a part, and a process killed while making leaves nothing that counts."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the node's other processes wait here
        if path.exists():
            return path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        _remove(tmp)
        try:
            make(tmp)
            os.replace(tmp, path)
        finally:
            _remove(tmp)
    return path


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def user_cache(kind: str) -> Path:
    """This user's cache folder for ``kind`` (``$XDG_CACHE_HOME/ddp-recipes/<kind>``, by
    default under ~/.cache)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ddp-recipes" / kind


def local_folder(where: str, storage_options: dict[str, Any], kind: str) -> Path:
    """``where`` as a local folder: itself, or (an fsspec URL) this node's copy of it in
    ``user_cache(kind)``, downloaded once. A URL with nothing under it raises
    FileNotFoundError."""
    from ddp_utils.urls import fs_options, is_url, local_path

    if not is_url(where):
        return Path(local_path(where)).expanduser()
    import hashlib

    import fsspec

    url = where.rstrip("/")
    digest = hashlib.sha1(url.encode()).hexdigest()[:16]

    def download(tmp: Path) -> None:
        fs, base = fsspec.core.url_to_fs(url, **fs_options(url, storage_options))
        if not fs.exists(base):
            raise FileNotFoundError(url)
        fs.get(base.rstrip("/") + "/", str(tmp), recursive=True)

    return made_once(user_cache(kind) / f"{digest}-{url.rsplit('/', 1)[-1]}", download)
