"""A callback for `make bench-peer ARGS=--profile`: ``torch.profiler`` over a window of
train.py's steps on rank 0, the operator table written where bench/peer.py reads it.

    callbacks='[{_target_: peer_profile.Profile, steps: 100, out: PATH}]'  (bench/ on PYTHONPATH)

Every rank steps the profiler's schedule (ranks stay alike), only rank 0 records. The peer
loop (bench/peer_reference.py --profile-steps N --profile-out PATH) profiles the same window
with the same function, so the two tables compare line for line.
"""

from __future__ import annotations

from typing import Any

import torch
from profile_window import WARMUP, start_profiler

from ddp_utils.train.callbacks import Callback


class Profile(Callback):
    def __init__(self, steps: int = 100, out: str = "profile.txt") -> None:
        self.steps, self.out = steps, out
        self.prof: torch.profiler.profile | None = None
        self.done = 0

    def on_train_start(self, tr: Any) -> None:
        self.prof = start_profiler(self.steps, self.out, tr.rt.is_main)

    def on_step_end(self, tr: Any) -> None:
        self.done += 1
        if self.prof is not None and self.done <= WARMUP + 1 + self.steps:
            self.prof.step()
            if self.done == WARMUP + 1 + self.steps:
                self.prof.stop()
