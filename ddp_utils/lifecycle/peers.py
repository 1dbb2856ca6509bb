"""When another rank is gone: what a failed collective says about it (``lost_peer``), leaving
the group after one (``process_group_left``), the end of an in-process sweep
(``finish_together``), a worker that outlives torchrun's agent (``stop_with_launcher``), and
the error file torchrun reports as the root cause (``write_error_file``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch.distributed as dist

from ddp_utils.dist import (
    LEAVE_WAIT_S,
    barrier,
    join_launch_group,
    read_launch_env,
    shutdown,
)


@contextlib.contextmanager
def process_group_left(leave: bool = True) -> Iterator[None]:
    """Run the body, then leave the process group (``shutdown``) when ``leave``. After a
    collective that failed for a lost peer, the survivors leave at once: waiting
    ``LEAVE_WAIT_S`` for a rank that will never come would hold each survivor that long, and
    an elastic agent would re-form the smaller group that much later. An error may say how
    long to wait for the others at most (``leave_wait_s``: a stop signal's,
    ddp_utils.lifecycle.preemption)."""
    try:
        yield
    except BaseException as e:
        if leave:
            cause = e.__context__ if e.__context__ is not None else e
            shutdown(together=lost_peer(e) is None and lost_peer(cause) is None,
                     wait_s=getattr(e, "leave_wait_s", LEAVE_WAIT_S))  # fmt: skip
        raise
    if leave:
        shutdown()


def finish_together(timeout_s: float = 300.0) -> None:
    """Every launched rank waits here for all the others, then leaves the process group.

    For the end of an in-process sweep: torchrun stops the other workers as soon as one
    exits, so a rank that finished its jobs first would kill global rank 0 before it wrote
    the last job's record. When every job failed before joining the group, a gloo group is
    made just for this meeting.
    """
    launch = read_launch_env()
    if launch.world_size > 1 and not dist.is_initialized():
        join_launch_group(launch, "gloo", timedelta(seconds=timeout_s))
    barrier()
    shutdown()


# What a collective raises when the rank at the other end is gone (gloo, NCCL, the stores).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited", "NCCL communicator was aborted")  # fmt: skip


def lost_peer(e: BaseException) -> str | None:
    """Why a collective failed when the cause is another rank (gone, or not answering within
    ``trainer.timeout_s``); None for any other error."""
    text = str(e)
    if isinstance(e, RuntimeError) and any(marker in text for marker in PEER_GONE):
        return "another rank is gone"
    if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "Timed out" in text):
        return "another rank stopped answering"
    return None


LAUNCHER_POLL_S = 0.5
PARENT_GONE_EXIT = 1  # if the group kill did not end this process first


def stop_with_launcher(env: Mapping[str, str] | None = None) -> None:
    """Under torchrun: end this worker, and its DataLoader workers, soon after the agent dies.

    The agent starts each worker in a session of its own, so the agent's death (the OOM
    killer, ``kill -9`` of the launcher, a lost container init) reaches no worker: they would
    train on, hold the run lock and, in a sweep, take trials nobody waits for. A thread notices
    this process being reparented and kills its process group at once, as a lost machine would:
    checkpoints are written atomically, so the last good one stays whole, the kernel drops the
    run lock with the process, and a relaunch resumes from that checkpoint.
    """
    env = os.environ if env is None else env
    if not env.get("TORCHELASTIC_RUN_ID"):
        return  # a plain process may be meant to outlive its shell (nohup)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        with contextlib.suppress(OSError):
            os.write(2, f"[pid {os.getpid()}] error: torchrun's agent (pid {parent}) is gone; "
                        "stopping this worker. Relaunch the same command to resume from the "
                        "last checkpoint.\n".encode())  # fmt: skip
        # The agent made this worker a session (and group) leader: the group is the worker
        # and its DataLoader workers, nothing else.
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def write_error_file(message: str) -> None:
    """torchrun's error file for this worker (the format ``record`` writes), if it has one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": extra}}, f)
