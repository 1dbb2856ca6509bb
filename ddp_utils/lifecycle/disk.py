"""Full disks, quotas, read-only mounts and lost permissions: whatever the writer raised, one
paragraph that names the folder, its free space and the fix (``UnwritableError``, exit code
4), and nothing partial left behind (the writers write whole files and rename them)."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from ddp_utils.config import UserError

WRITE_FAILED_EXIT = 4
# What a full disk, a quota, a read-only mount or lost permissions raise while writing.
UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


class UnwritableError(UserError):
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
