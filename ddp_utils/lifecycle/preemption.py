"""Stopping cleanly on SIGTERM or SIGUSR1: every rank at the same step, with a checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
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

    # A stop before training or while the run ends: a rank that left on the signal waits this
    # long at most for the others to leave the group (one stuck in C++ ends after
    # STUCK_GRACE_S), not the 30 s a finished run waits.
    leave_wait_s = 5.0

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
_in_loop = False  # whether the training loop holds the stop signals now (StopRequest)
_stopping = False  # whether a stop signal has reached a Python handler in this job
# How long a stop signal may wait for its Python handler: one runs only once the main thread
# is back in Python, and a call blocked in C++ (a rank's collective or store wait whose peer
# already left on the same signal) may not return for the group's timeout.
STUCK_GRACE_S = 3.0


def _stop_now(signum: int, frame: FrameType | None) -> None:
    global _stopping
    # A forked DataLoader worker inherits the handler: its parent ends it, quietly.
    if os.getpid() == _owner:
        _stopping = True
        raise StoppedEarly(signum)


class _StuckWatch:
    """A thread that sees each stop signal as it arrives (Python's wakeup fd: the C-level
    handler writes the signal's number there at once, whatever the main thread is doing)
    and, outside the training loop, calls ``on_stuck`` with the stop if no Python handler
    took it within ``STUCK_GRACE_S``: the main thread is stuck in C++."""

    def __init__(self, on_stuck: Callable[[StoppedEarly], None]) -> None:
        self.on_stuck, self.closed = on_stuck, False
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self.watch, name="stop-signal-watch", daemon=True)
        self.thread.start()

    def watch(self) -> None:
        try:
            while data := os.read(self.read_fd, 64):
                for signum in data:
                    if signum in STOP_SIGNALS and not _in_loop and not _stopping:
                        time.sleep(STUCK_GRACE_S)
                        # the job ended meanwhile (a sweep's next may have begun): not ours
                        if self.closed:
                            return
                        if not _in_loop and not _stopping and os.getpid() == _owner:
                            self.on_stuck(StoppedEarly(signum))
        finally:
            os.close(self.read_fd)  # here, not in close(): a sleeping watch still holds it

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self.previous)
        os.close(self.write_fd)  # the watch reads the pipe's end and returns


def _forget_wakeup_fd() -> None:
    # A forked child (a DataLoader worker) writes no signal into its parent's pipe.
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_forget_wakeup_fd)


@contextlib.contextmanager
def stop_signals_act_at_once(
    on_stuck: Callable[[StoppedEarly], None] | None = None,
) -> Iterator[None]:
    """Around a job: until the training loop takes the stop signals over (``StopRequest``),
    each one raises ``StoppedEarly`` where the process is. The handlers before are restored
    after, so ``pass_on`` still reaches submitit's. ``on_stuck(stop)``: what to do when the
    main thread has not taken a stop signal within ``STUCK_GRACE_S`` (it must end the
    process); None: wait for it."""
    global _owner, _trained, _in_loop, _stopping
    _owner, _trained, _in_loop, _stopping = os.getpid(), False, False, False
    previous = {s: signal.signal(s, _stop_now) for s in STOP_SIGNALS}
    watch = None
    if on_stuck is not None and threading.current_thread() is threading.main_thread():
        watch = _StuckWatch(on_stuck)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if watch is not None:
            watch.close()


class StopRequest:
    """Catches the stop signals and makes every rank agree on the step to stop at.

    Ranks get a signal at slightly different moments (or only some get it), so each rank's
    flags (the signal, and ``diverged``: a non-finite loss seen by this rank) are combined
    with a MAX all-reduce on a gloo group of its own (NCCL runs need no host-device sync for
    it). The reduce is not made every step: at 1,000 ranks a gloo all-reduce costs
    milliseconds, a step's worth on a fast GPU. Every rank reduces at the same steps, the
    *poll steps*, about ``every_s`` apart: the reduce started at one poll step is read at the
    next, so it overlaps with the steps between, and all ranks see the same answer at the same
    step. The main rank times the steps and proposes the next gap in the same reduce (the other
    ranks send 0; MAX keeps its value), so the gap is agreed as the answer is. A stop comes at
    most about ``2 * every_s`` after the signal, and at the latest at the next checkpoint or the
    run's end, where the ranks agree at once (``poll(sync=True)``).
    """

    MAX_GAP = 10_000  # steps between two polls at most

    def __init__(self, timeout: timedelta, every_s: float = 0.5) -> None:
        self.signum = 0
        self.diverged = False
        self.training = False  # until ``begin``: a signal stops at once (StoppedEarly)
        self.every_s = every_s
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._main = not self._distributed or dist.get_rank() == 0
        self._group = dist.new_group(backend="gloo", timeout=timeout) if self._distributed else None
        self._flag = torch.zeros(3, dtype=torch.int64)
        self._pending: dist.Work | None = None
        self._gap = 1  # steps from this poll step to the next (agreed)
        self._countdown = 1  # steps until the next poll step
        self._polled_at = time.perf_counter()
        self.reduces = 0  # all-reduces started (a benchmark's count)

    def begin(self) -> None:
        """The training loop starts: from now on a signal is a checkpointed stop at the next
        step boundary, agreed by every rank."""
        global _trained, _in_loop
        self.training = _trained = _in_loop = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.training:
            _stop_now(signum, frame)
            return
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            # A second Ctrl-C: the user does not want to wait for the checkpoint.
            os.write(2, b"second Ctrl-C: stopping now, without a checkpoint\n")
            os._exit(INTERRUPTED_EXIT)
        self.signum = self.signum or signum

    def poll(self, sync: bool = False) -> bool:
        """Called by every rank at every step boundary: True when all ranks should stop now
        (``signum`` then says why, or ``diverged``). ``sync``: a checkpoint or the run's end
        follows this step (every rank passes the same): the ranks agree now, on what they
        hold now, so a signal that came since the last poll step is not left behind."""
        if not self._distributed:
            return self.signum != 0 or self.diverged
        self._countdown -= 1
        if self._countdown > 0 and not sync:
            return False
        agreed, stepped = False, self._gap - max(self._countdown, 0)  # since the last poll
        if self._pending is not None:
            self._pending.wait()
            signum, diverged, gap = (int(v) for v in self._flag.tolist())
            agreed = self._agree(signum, diverged)
            self._gap = max(1, gap)
        if sync and not agreed:
            now = torch.tensor([self.signum, int(self.diverged)], dtype=torch.int64)
            dist.all_reduce(now, op=dist.ReduceOp.MAX, group=self._group)
            agreed = self._agree(*(int(v) for v in now.tolist()))
            self.reduces += 1
        self._countdown = self._gap
        self._flag = torch.tensor([self.signum, int(self.diverged), self._next_gap(stepped)],
                                  dtype=torch.int64)  # fmt: skip
        self._pending = dist.all_reduce(
            self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True
        )
        self.reduces += 1
        return agreed

    def _agree(self, signum: int, diverged: int) -> bool:
        """Take the ranks' reduced flags as this rank's; whether they ask to stop."""
        self.diverged = self.diverged or diverged != 0
        if signum and not self.signum:
            self.signum = signum  # another rank got it; stop as one
        return signum != 0 or diverged != 0

    def _next_gap(self, stepped: int) -> int:
        """The main rank's proposal: the steps that take about ``every_s``, at the pace of the
        ``stepped`` steps since the last poll (0 from the others)."""
        now = time.perf_counter()
        per_step, self._polled_at = (now - self._polled_at) / stepped, now
        if not self._main:
            return 0
        return int(min(self.MAX_GAP, max(1, self.every_s / max(per_step, 1e-9))))

    def close(self, drain: bool = True) -> None:
        """Restore the signal handlers; ``drain`` waits for the last reduce (skip it when a
        rank may be gone, or it would wait out the timeout once more)."""
        global _in_loop
        _in_loop = False
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
