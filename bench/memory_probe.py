"""A callback of `make bench-memory` (never part of the product): after each optimizer step,
this rank's bytes of parameters, gradients and optimizer state (its shards under fsdp2, whole
tensors under ddp), its peak memory up to its last step (the final validation and checkpoint
left out: resident memory on a CPU, ``max_memory_allocated`` on a GPU) and the step's wall
time (the GPU synchronised first); rank by rank into ``folder/rank<R>.json`` at
the end of training.

callbacks=[{_target_:memory_probe.MemoryProbe,folder:/tmp/mem}]  (bench/ on PYTHONPATH)
"""

from __future__ import annotations

import json
import resource
import statistics
from pathlib import Path

import torch
from devices import clock

from ddp_utils.train.callbacks import Callback


def local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


class MemoryProbe(Callback):
    def __init__(self, folder: str) -> None:
        self.folder, self.times, self.state = Path(folder), [], {}
        self.last, self.peak = 0.0, 0

    def on_train_start(self, tr) -> None:
        self.last = clock(tr.rt.device)

    def on_step_end(self, tr) -> None:
        now = clock(tr.rt.device)
        self.times.append(now - self.last)
        self.last = now
        params = list(tr.raw_model.parameters())
        optim = [v for s in tr.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.ndim > 0]  # fmt: skip
        # the peak so far, before the run's last validation and checkpoint (what training needs)
        if tr.rt.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(tr.rt.device)
        else:
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.state = {
            "params": sum(local_bytes(p) for p in params),
            # set to None after each step: as large as the parameters they belong to
            "grads": sum(local_bytes(p) for p in params if p.requires_grad),
            "optimizer": sum(local_bytes(v) for v in optim),
        }

    def on_train_end(self, tr) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {
            "state_bytes": self.state,
            "peak_bytes": self.peak,
            "peak_kind": "allocated" if tr.rt.device.type == "cuda" else "resident",
            "step_s": statistics.median(self.times[1:]) if len(self.times) > 1 else None,
        }
        (self.folder / f"rank{tr.rt.rank}.json").write_text(json.dumps(record))
