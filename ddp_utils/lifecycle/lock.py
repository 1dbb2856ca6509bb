"""One job per run_dir: an OS file lock on ``run_dir/.lock``, held by global rank 0.

The lock is ``flock``: the kernel drops it when the holding process ends in any way (SIGKILL
included), so a dead job never blocks the next launch; on NFSv4 the server drops it when the
dead client's lease runs out (about 90 s). The file also names the holder (host, pid, start
time, job) for the message a second job gets. The same job passes: torchrun's restarts share
its run id, a requeued SLURM job keeps its job id, and their earlier processes are gone (or,
on another node after a node loss, are the same job by name).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ddp_utils.config import ConfigError
from ddp_utils.dist import read_launch_env

LOCK_NAME = ".lock"


def job_identity(env: dict[str, str] | None = None) -> str:
    """What stays the same across this job's restarts: SLURM's job id, else torchrun's run id,
    else (a single process) this host and pid."""
    env = dict(os.environ) if env is None else env
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    run_id = read_launch_env(env).run_id
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    return f"process:{socket.gethostname()}:{os.getpid()}"


class RunLock:
    """Held from ``acquire`` until ``release`` (or the process's end)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Take the lock, or raise ConfigError naming the job that holds it."""
        path = run_dir / LOCK_NAME
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "job": job_identity()}  # fmt: skip
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            if holder.get("job") == me["job"]:
                return cls(path, None)  # this job's earlier process, still being torn down
            raise ConfigError(busy_message(run_dir, holder)) from None
        except OSError as e:  # a filesystem without flock (Lustre without -o flock, ...)
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                return cls(path, None)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        return cls(path, fd)

    @staticmethod
    def held(run_dir: Path) -> bool:
        """Whether a live process holds ``run_dir``'s lock now (without taking it)."""
        try:
            fd = os.open(run_dir / LOCK_NAME, os.O_RDWR)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)  # closing also drops a lock this call took
        return False

    def release(self) -> None:
        """Unlock (the file stays: removing it could let two later jobs lock two files)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def _read(fd: int) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    return {}


def _read_holder(fd: int, wait_s: float = 2.0) -> dict[str, Any]:
    # The holder writes its note just after it locks: a read in between finds the file empty
    # (or half written), so wait a moment for the note before naming an unknown holder.
    deadline = time.monotonic() + wait_s
    while not (holder := _read(fd)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return holder


def busy_message(run_dir: Path, holder: dict[str, Any]) -> str:
    who = (f"job {holder.get('job', '?')} (pid {holder.get('pid', '?')} on "
           f"{holder.get('host', '?')}, started {holder.get('started', '?')})")  # fmt: skip
    return (
        f"run_dir={run_dir} is in use by another job: {who}. Two jobs in one run_dir would "
        "overwrite each other's checkpoints and metrics. Wait for it to end (or stop it), or "
        "give this launch another run_dir=PATH."
    )
