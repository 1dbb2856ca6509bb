"""``logger=wandb``: Weights & Biases, offline unless you have set it up.

Offline (the default without ``WANDB_API_KEY`` or ``WANDB_MODE``): the run's files go to
``run_dir/wandb/offline-run-*``; ``wandb sync run_dir/wandb/offline-run-*`` uploads them
later. The run's id is in the checkpoint, so a resumed run continues it (``resume="allow"``)
and the config is logged once, by the first start.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from ddp_utils.tracking.base import TrackedRun, Tracker, flat_config


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, project: str = "ddp-recipes", entity: str | None = None,
                 mode: str | None = None) -> None:  # fmt: skip
        self.project, self.entity, self.mode = project, entity, mode
        self.run, self.last_step = None, 0

    def start(self, run: TrackedRun) -> int | None:
        import wandb

        mode = self.mode or os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline")  # fmt: skip
        resumed = run.resumed_state(self.name) or {}
        run_id = resumed.get("id") or secrets.token_hex(4)  # W&B's own ids: 8 characters
        self.run = wandb.init(
            project=self.project, entity=self.entity, name=run.name, id=run_id, resume="allow",
            dir=str(run.run_dir), mode=mode, config=None if resumed else flat_config(run.config),
            settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip
        self.last_step = int(resumed.get("step", 0))
        return self.last_step

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)
        self.last_step = step

    def state(self) -> dict[str, Any]:
        return {"id": None if self.run is None else self.run.id, "step": self.last_step}

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
