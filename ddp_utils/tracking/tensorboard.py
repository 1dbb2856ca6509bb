"""``logger=tensorboard``: scalars into ``run_dir/tb``."""

from __future__ import annotations

from ddp_utils.tracking.base import TrackedRun, Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, subdir: str = "tb") -> None:
        self.subdir, self.writer = subdir, None

    def start(self, run: TrackedRun) -> int | None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run.run_dir / self.subdir))
        return None  # a resumed run's earlier event files stay; it logs from here on

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
