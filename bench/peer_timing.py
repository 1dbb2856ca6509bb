"""A callback for `make bench-peer`: wall-clock stamps of train.py's run, the same events the
peer loop prints (its first step, each epoch's end with its rate and top-1).

    callbacks='[{_target_: peer_timing.Timing}]'   (with bench/ on PYTHONPATH)
"""

from __future__ import annotations

import json
import time
from typing import Any

from ddp_utils.train.callbacks import Callback


class Timing(Callback):
    def __init__(self) -> None:
        self.stepped = False

    def emit(self, tr: Any, **record: Any) -> None:
        if tr.rt.is_main:
            print("PEER " + json.dumps(record), flush=True)

    def on_step_end(self, tr: Any) -> None:
        if not self.stepped:
            self.stepped = True
            self.emit(tr, event="first_step", time=time.time())

    def on_epoch_end(self, tr: Any, record: dict[str, Any]) -> None:
        self.emit(tr, event="epoch", epoch=record["epoch"], img_s=record["samples_per_s"],
                  top1=record.get("val/accuracy"), time=time.time())  # fmt: skip
