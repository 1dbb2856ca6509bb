"""A per-rank watchdog: a rank that makes no training step for ``trainer.timeout_s`` exits.

The collective timeout ends the ranks that wait on a stalled peer, but not the stalled rank
itself, and torchrun then waits its 30 s grace period on it. With the watchdog the stalled
rank leaves too, so the whole job ends within ``trainer.timeout_s`` plus a moment.
"""

from __future__ import annotations

import os
import sys
import threading
import time

STALLED_EXIT = 1


class StepWatchdog:
    """Armed by the first ``beat()`` of an epoch, disarmed between epochs (validation, saves
    at epoch end and start-up are not counted)."""

    def __init__(self, timeout_s: float, rank: int, poll_s: float = 0.5) -> None:
        self.timeout_s, self.rank, self.poll_s = timeout_s, rank, poll_s
        self._last: float | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def disarm(self) -> None:
        self._last = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            last = self._last
            if last is not None and time.monotonic() - last > self.timeout_s:
                sys.stderr.write(
                    f"[rank {self.rank}] error: no training step for {self.timeout_s:.0f} s "
                    "(trainer.timeout_s): this rank is stuck; exiting so the job can end.\n"
                )
                sys.stderr.flush()
                os._exit(STALLED_EXIT)
