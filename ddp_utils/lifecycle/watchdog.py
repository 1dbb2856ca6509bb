"""A per-rank watchdog: a rank that makes no progress for ``trainer.timeout_s`` exits.

The collective timeout ends the ranks that wait on a stalled peer, but not the stalled rank
itself (a DataLoader worker that blocks, on a hung file system say, leaves its rank waiting on
the worker's queue for ever), and torchrun then waits its 30 s grace period on it. With the
watchdog the stalled rank leaves too, naming what it waited for, so the whole job ends within
``trainer.timeout_s`` plus a moment.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from ddp_utils.lifecycle.peers import write_error_file

STALLED_EXIT = 1
OTHERS_PAUSE_S = 2.0
# What each phase waits for, for the message: (the event that did not come, where it is stuck).
PHASES = {
    "train": ("training step", "its training loader, the model or a collective"),
    "val": ("validation batch", "its validation loader (a DataLoader worker that blocks?) or "
            "the model"),
}  # fmt: skip


class StepWatchdog:
    """Armed by the first ``beat()`` of a phase (training steps, validation batches), disarmed
    between them (saves at epoch end, start-up and collectives outside them are not timed)."""

    def __init__(self, timeout_s: float, rank: int, poll_s: float = 0.5) -> None:
        self.timeout_s, self.rank, self.poll_s = timeout_s, rank, poll_s
        self._last: tuple[float, str] | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase: str = "train") -> None:
        self._last = (time.monotonic(), phase)

    def disarm(self) -> None:
        self._last = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            last = self._last
            if last is not None and time.monotonic() - last[0] > self.timeout_s:
                if self.rank != 0:
                    # A stuck collective stalls every rank at once: the main rank's line is the
                    # job's one message (torchrun ends the others when it exits); another
                    # rank's comes only if this one is still running, and stuck, after a pause.
                    time.sleep(OTHERS_PAUSE_S)
                    if self._last is not last:
                        continue
                event, where = PHASES[last[1]]
                line = (
                    f"[rank {self.rank}] error: no {event} for {self.timeout_s:.0f} s "
                    f"(trainer.timeout_s): this rank is stuck in {where}; exiting so the job "
                    "can end."
                )
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
                write_error_file(line)  # torchrun's root cause: this rank, this line
                os._exit(STALLED_EXIT)
