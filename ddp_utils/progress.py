"""What the main rank shows while training: a tqdm bar on a terminal, else plain log lines."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from ddp_utils.logs import log


class Progress:
    """Per-epoch progress of the main rank; other ranks show nothing.

    ``update`` is called every optimizer step and reads nothing from the device; ``report``
    is called at log points with the (synchronised) running loss. With a bar, the loss goes
    into the bar's postfix; without one (``trainer.progress=auto`` and stderr not a
    terminal, e.g. a log file or CI), one plain line is logged, so files carry no bar
    fragments.
    """

    def __init__(self, mode: str, is_main: bool, total_steps: int, samples_per_step: int,
                 unit: str = "img",
                 mfu_of: Callable[[float], float] | None = None) -> None:  # fmt: skip
        show_bar = mode == "true" or (mode == "auto" and sys.stderr.isatty())
        self.bar_enabled = is_main and show_bar
        self.total_steps, self.samples_per_step = total_steps, samples_per_step
        self.unit = unit  # what samples_per_step counts: img, or tok for token data
        self.mfu_of = mfu_of  # samples_per_step's unit a second -> model FLOPs utilisation
        self.bar: tqdm | None = None
        self.start, self.start_step = time.perf_counter(), 0

    def start_epoch(self, epoch: int, step: int, steps_in_epoch: int) -> None:
        self.epoch, self.start, self.start_step = epoch, time.perf_counter(), step
        if self.bar_enabled:
            self.bar = tqdm(total=steps_in_epoch, desc=f"epoch {epoch}", unit="step",
                            dynamic_ncols=True, leave=True, file=sys.stderr)  # fmt: skip

    def rate(self, step: int) -> tuple[float, float]:
        """(samples/s, seconds left in the run) from the steps of this epoch so far."""
        done = max(step - self.start_step, 1)
        per_step = (time.perf_counter() - self.start) / done
        return self.samples_per_step / per_step, per_step * max(self.total_steps - step, 0)

    def update(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, loss: float, lr: float) -> None:
        """Main rank only (the caller reads the loss there alone)."""
        images_s, left = self.rate(step)
        eta = str(datetime.timedelta(seconds=round(left)))
        mfu = f"{100 * self.mfu_of(images_s):.1f}%" if self.mfu_of is not None else "n/a"
        if self.bar is not None:
            rate = {f"{self.unit}_s": f"{images_s:.0f}"}
            self.bar.set_postfix(loss=f"{loss:.4f}", **rate, mfu=mfu, left=eta)
        else:
            log.info("epoch %d | step %d/%d | loss %.4f | lr %.4g | %.0f %s/s | mfu %s | %s left",
                     self.epoch, step, self.total_steps, loss, lr, images_s, self.unit, mfu,
                     eta)  # fmt: skip

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
