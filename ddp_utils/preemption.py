"""Stopping cleanly on SIGTERM or SIGUSR1: every rank at the same step, with a checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: the run stopped early on purpose; relaunch it to resume
INTERRUPTED_EXIT = 130  # 128 + SIGINT: what a shell reports for Ctrl-C; relaunch to resume
# SLURM's time-limit warning is the one `--signal` names (SIGUSR1 in Lightning's and our srun
# examples, SIGUSR2 under submitit); preemption and scancel send SIGTERM.
# Ctrl-C (SIGINT) stops the same way; a second Ctrl-C ends the process at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class Preempted(Exception):
    """Raised once the checkpoint of a requested stop is written."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}")
        self.step, self.signum = step, signum

    @property
    def exit_code(self) -> int:
        return INTERRUPTED_EXIT if self.signum == signal.SIGINT else PREEMPTED_EXIT


class StoppedEarly(BaseException):
    """A stop signal outside the training loop: before the first training step (nothing to
    save) or while the run ends (after its last checkpoint, or after an error), so it acts at
    once, raised from the handler itself, which also breaks a call that blocks (a tracker's
    server that never answers, a data check, a model probe). A BaseException, as
    KeyboardInterrupt: the ``except Exception`` around a library call must not take it for
    that call's error."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        self.signum = signum
        if _trained:
            super().__init__(f"stopped by {name} while the run was ending; relaunch the same "
                             "command to resume from its newest checkpoint")  # fmt: skip
        else:
            super().__init__(f"stopped by {name} before the first training step; nothing was "
                             "saved; relaunch the same command to start again")  # fmt: skip

    @property
    def exit_code(self) -> int:
        return INTERRUPTED_EXIT if self.signum == signal.SIGINT else PREEMPTED_EXIT


_owner = os.getpid()  # the process whose handlers these are
_trained = False  # whether this job's training loop has begun (StopRequest.begin)


def _stop_now(signum: int, frame: FrameType | None) -> None:
    # A forked DataLoader worker inherits the handler: its parent ends it, quietly.
    if os.getpid() == _owner:
        raise StoppedEarly(signum)


@contextlib.contextmanager
def stop_signals_act_at_once() -> Iterator[None]:
    """Around a job: until the training loop takes the stop signals over (``StopRequest``),
    each one raises ``StoppedEarly`` where the process is. The handlers before are restored
    after, so ``pass_on`` still reaches submitit's."""
    global _owner, _trained
    _owner, _trained = os.getpid(), False
    previous = {s: signal.signal(s, _stop_now) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class StopRequest:
    """Catches the stop signals and makes every rank agree on the step to stop at.

    Ranks get a signal at slightly different moments (or only some get it), so each rank's
    flags (the signal, and ``diverged``: a non-finite loss seen by this rank) are combined
    with a MAX all-reduce. The reduce of step ``k`` is started without
    waiting and read at step ``k + 1``, so it overlaps with compute; it runs on a separate
    gloo group, so NCCL runs need no host-device sync for it. Every rank polls at every step,
    hence all see the same answer at the same step.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.signum = 0
        self.diverged = False
        self.training = False  # until ``begin``: a signal stops at once (StoppedEarly)
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._group = dist.new_group(backend="gloo", timeout=timeout) if self._distributed else None
        self._flag = torch.zeros(2, dtype=torch.int32)
        self._pending: dist.Work | None = None

    def begin(self) -> None:
        """The training loop starts: from now on a signal is a checkpointed stop at the next
        step boundary, agreed by every rank."""
        global _trained
        self.training = _trained = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.training:
            _stop_now(signum, frame)
            return
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            # A second Ctrl-C: the user does not want to wait for the checkpoint.
            os.write(2, b"second Ctrl-C: stopping now, without a checkpoint\n")
            os._exit(INTERRUPTED_EXIT)
        self.signum = self.signum or signum

    def poll(self) -> bool:
        """Called by every rank at every step boundary: True when all ranks should stop now
        (``signum`` then says why, or ``diverged``)."""
        if not self._distributed:
            return self.signum != 0 or self.diverged
        agreed = False
        if self._pending is not None:
            self._pending.wait()
            signum, diverged = (int(v) for v in self._flag.tolist())
            agreed = signum != 0 or diverged != 0
            self.diverged = self.diverged or diverged != 0
            if signum and not self.signum:
                self.signum = signum  # another rank got it; stop as one
        self._flag = torch.tensor([self.signum, int(self.diverged)], dtype=torch.int32)
        self._pending = dist.all_reduce(
            self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True
        )
        return agreed

    def close(self, drain: bool = True) -> None:
        """Restore the signal handlers; ``drain`` waits for the last reduce (skip it when a
        rank may be gone, or it would wait out the timeout once more)."""
        if drain and self._pending is not None:
            self._pending.wait()
        self._pending = None
        if drain and self._group is not None:
            # A sweep runs many jobs in one process group: each job's side group goes with it.
            # (Not after a failure: a pending reduce with a peer gone could hold it.)
            dist.destroy_process_group(self._group)
            self._group = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def pass_on(signum: int) -> None:
    """Once the checkpoint is written, give the stop signal to the Python handler that was
    installed before ours, if any: under submitit that handler requeues the job (from global
    rank 0) and exits. With no such handler (plain torchrun, srun) this does nothing."""
    handler = signal.getsignal(signum)
    if callable(handler) and handler is not signal.default_int_handler:  # not KeyboardInterrupt
        handler(signum, None)
