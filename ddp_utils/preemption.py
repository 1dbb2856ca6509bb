"""Stopping cleanly on SIGTERM or SIGUSR1: every rank at the same step, with a checkpoint."""

from __future__ import annotations

import signal
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: the run stopped early on purpose; relaunch it to resume
# SLURM's time-limit warning is the one `--signal` names (SIGUSR1 in Lightning's and our srun
# examples, SIGUSR2 under submitit); preemption and scancel send SIGTERM.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Preempted(Exception):
    """Raised once the checkpoint of a requested stop is written."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}")
        self.step, self.signum = step, signum


class StopRequest:
    """Catches the stop signals and makes every rank agree on the step to stop at.

    Ranks get a signal at slightly different moments (or only some get it), so each rank's
    flag is combined with a MAX all-reduce. The reduce of step ``k`` is started without
    waiting and read at step ``k + 1``, so it overlaps with compute; it runs on a separate
    gloo group, so NCCL runs need no host-device sync for it. Every rank polls at every step,
    hence all see the same answer at the same step.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.signum = 0
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._group = dist.new_group(backend="gloo", timeout=timeout) if self._distributed else None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pending: dist.Work | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def poll(self) -> bool:
        """Called by every rank at every step boundary: True when all ranks should stop now."""
        if not self._distributed:
            return self.signum != 0
        agreed = False
        if self._pending is not None:
            self._pending.wait()
            agreed = int(self._flag.item()) != 0
        self._flag = torch.tensor([self.signum], dtype=torch.int32)
        self._pending = dist.all_reduce(
            self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True
        )
        if agreed and not self.signum:
            self.signum = signal.SIGTERM  # another rank got it; stop as one
        return agreed

    def close(self, drain: bool = True) -> None:
        """Restore the signal handlers; ``drain`` waits for the last reduce (skip it when a
        rank may be gone, or it would wait out the timeout once more)."""
        if drain and self._pending is not None:
            self._pending.wait()
        self._pending = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def pass_on(signum: int) -> None:
    """Once the checkpoint is written, give the stop signal to the Python handler that was
    installed before ours, if any: under submitit that handler requeues the job (from global
    rank 0) and exits. With no such handler (plain torchrun, srun) this does nothing."""
    handler = signal.getsignal(signum)
    if callable(handler):
        handler(signum, None)
