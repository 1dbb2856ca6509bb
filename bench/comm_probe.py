"""A callback of `make bench-comm` (never part of the product): at the end of training, rank
0 writes the gradient bytes one optimizer step all-reduces under ``trainer.ddp.comm_hook``
(fp32: 4 a value; fp16 and bf16: 2) into ``path``.

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
        rate, per_value = (2.0, 2) if hook in ("fp16", "bf16") else (1.0, 4)
        self.path.write_text(json.dumps({"bytes_per_step": numel * per_value, "rate": rate}))
