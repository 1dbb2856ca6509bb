"""Atomic file writes: a reader, or a restart, sees the old file or the whole new one."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ddp_utils.config import ConfigError

WRITE_FAILED_EXIT = 4
# What a full disk, a quota, a read-only mount or lost permissions raise while writing.
UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


class UnwritableError(ConfigError):
    """The run's files cannot be written (no space, quota, read-only, permission)."""

    exit_code = WRITE_FAILED_EXIT


def _size(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def unwritable_cause(e: BaseException) -> OSError | None:
    """The ``UNWRITABLE`` OSError behind ``e``, if any. Writers wrap it in errors of their own
    (torch.save's zip writer raises RuntimeError "unexpected pos" chained from ENOSPC), so the
    whole chain of causes is searched, not the type of the error that reached us."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in UNWRITABLE:
            return cause
        # torch.distributed.checkpoint gathers every rank's failure into one exception
        for failure in (getattr(cause, "failures", None) or {}).values():
            failure = failure[0] if isinstance(failure, tuple) else failure  # (error, traceback)
            if isinstance(failure, BaseException) and (found := unwritable_cause(failure)):
                return found
        cause = cause.__cause__ or cause.__context__
    return None


def unwritable(e: OSError, run_dir: Path, key: str = "run_dir") -> UnwritableError:
    """The one paragraph for an ``UNWRITABLE`` error while writing into ``run_dir`` (the
    folder that config ``key`` names: a run's, or eval.py's ``output``)."""
    try:
        usage = shutil.disk_usage(run_dir)
        space = f"{_size(usage.free)} free of {_size(usage.total)}"
    except OSError:
        space = "free space unknown"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = ("Free space there (older runs; fewer step checkpoints with trainer.keep_last=1), "
               f"or write to a larger disk with {key}=PATH")  # fmt: skip
    else:
        fix = f"Make the folder writable again, or write elsewhere with {key}=PATH"
    lasts = [run_dir / "checkpoints" / name for name in ("last.pt", "last.dcp")]
    last = next((p for p in lasts if p.exists()), lasts[0])  # a file, or a sharded folder
    resumes = key == "run_dir" and last.exists()
    again = f"; relaunching continues from the last good checkpoint, {last}" if resumes else ""
    return UnwritableError(
        f"cannot write {e.filename or run_dir} ({e.strerror or e}): {key}={run_dir} has "
        f"{space}. Nothing partial was left behind. {fix}{again}."
    )


@contextlib.contextmanager
def writing_into(folder: Path, key: str = "run_dir") -> Iterator[None]:
    """Writes into ``folder`` (which config ``key`` names) that fail for want of space or
    permission, whatever the writer raised, become the one ``UnwritableError`` paragraph."""
    try:
        yield
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is one
        cause = unwritable_cause(e)
        if cause is None:
            raise
        raise unwritable(cause, folder, key) from None


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
