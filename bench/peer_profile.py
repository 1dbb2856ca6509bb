"""A callback for `make bench-profile`: ``torch.profiler`` over a window of train.py's steps
on rank 0, the operator table written where bench/peer.py reads it.

    callbacks='[{_target_: peer_profile.Profile, steps: 100, out: PATH}]'  (bench/ on PYTHONPATH)

The peer loop (bench/peer_reference.py --profile-steps N --profile-out PATH) profiles the
same window with the same function (bench/profile_window.py), so the two tables compare
line for line.
"""

from __future__ import annotations

from typing import Any

from profile_window import start_profiler

from ddp_utils.train.callbacks import Callback


class Profile(Callback):
    def __init__(self, steps: int = 100, out: str = "profile.txt") -> None:
        self.steps, self.out = steps, out
        self.prof = None

    def on_train_start(self, tr: Any) -> None:
        self.prof = start_profiler(self.steps, self.out, tr.rt.is_main)

    def on_step_end(self, tr: Any) -> None:
        if self.prof is not None:
            self.prof.step()  # the schedule skips the warm-up and stops recording after it

    def on_train_end(self, tr: Any) -> None:
        if self.prof is not None:
            self.prof.stop()  # a run that ends inside the window still writes its table
