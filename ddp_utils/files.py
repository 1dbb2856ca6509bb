"""Atomic file writes: a reader, or a restart, sees the old file or the whole new one."""

from __future__ import annotations

import os
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
