"""A callback of `make bench-comm` (never part of the product): at the end of training, rank
0 writes the gradient bytes one optimizer step all-reduces under ``trainer.ddp.comm_hook``
(fp32: 4 a value; fp16 and bf16: 2; PowerSGD: 4 over its compression rate, from torch's own
count) into ``path``.

callbacks=[{_target_:comm_probe.CommProbe,path:/tmp/comm.json}]  (bench/ on PYTHONPATH)
"""

from __future__ import annotations

import json
from pathlib import Path

from ddp_utils.train.callbacks import Callback


class CommProbe(Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_end(self, tr) -> None:
        if not tr.rt.is_main:
            return
        numel = sum(p.numel() for p in tr.raw_model.parameters() if p.requires_grad)
        hook = tr.cfg.trainer.ddp.comm_hook
        if tr.strategy.powersgd is not None:
            rate = tr.strategy.powersgd.compression_rate()
            per_value = 4 / rate
        else:
            rate, per_value = (2.0, 2) if hook in ("fp16", "bf16") else (1.0, 4)
        self.path.write_text(json.dumps({"bytes_per_step": numel * per_value, "rate": rate}))
