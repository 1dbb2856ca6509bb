"""Fault injection for the fault-tolerance tests: kill or stall one rank at a given step.

Set ``DDP_RECIPES_FAULT=kill:STEP:RANK`` or ``stall:STEP:RANK`` in the environment. A kill
fires only in the first attempt (torchrun's restart count 0), so the restarted group runs on.
A stall writes ``DDP_RECIPES_FAULT_MARK`` (a path) with the time it began, then sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import time

ENV = "DDP_RECIPES_FAULT"


def maybe_inject(step: int, rank: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    kind, at_step, at_rank = spec.split(":")
    if step != int(at_step) or rank != int(at_rank):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stall":
        mark = os.environ.get("DDP_RECIPES_FAULT_MARK")
        if mark:
            with open(mark, "w") as f:
                f.write(str(time.time()))
        time.sleep(3600)


RECORD_ENV = "DDP_RECIPES_RECORD_SAMPLES"


class SampleRecorder:
    """With ``DDP_RECIPES_RECORD_SAMPLES=DIR``, each rank appends to ``DIR/rank<R>.jsonl`` the
    real (non-padding) sample indices of every optimizer step: the tests' ground truth for
    "each sample exactly once". Off (and free) when the variable is unset."""

    def __init__(self, rank: int) -> None:
        folder = os.environ.get(RECORD_ENV)
        self.path = os.path.join(folder, f"rank{rank}.jsonl") if folder else None
        self.rank, self.pending, self.order = rank, [], []

    def start_epoch(self, sampler_indices: list[int]) -> None:
        self.order = sampler_indices

    def add_batch(self, i: int, batch_size: int) -> None:
        if self.path:
            self.pending += [j for j in self.order[i * batch_size : (i + 1) * batch_size] if j >= 0]

    def flush(self, epoch: int, step: int) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"epoch": epoch, "step": step, "indices": self.pending}) + "\n")
            self.pending = []
