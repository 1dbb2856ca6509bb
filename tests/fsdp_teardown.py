"""One rank of a group started by tests/test_fsdp2_e2e.py (torchrun's variables set by the
test): a small model sharded by trainer.strategy=fsdp2, three AdamW steps, a sharded
checkpoint, then what train.py does at its end (every rank meets, then the group is torn
down) and a normal interpreter exit, where gloo's threads once aborted
("terminate called without an active exception")."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddp_utils.config import TrainerConfig  # noqa: E402
from ddp_utils.dist import barrier, init_distributed, shutdown  # noqa: E402
from ddp_utils.strategy import build_strategy  # noqa: E402


def main(run_dir: Path) -> None:
    trainer = TrainerConfig(strategy="fsdp2", precision="32", device="cpu", backend="gloo")
    rt = init_distributed(trainer)
    try:
        strategy = build_strategy(trainer, rt)
        model = strategy.wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        state = {"model": strategy.model_state_dict(), "step": 3, "config": {},
                 "optimizer": strategy.optimizer_state_dict(optimizer)}  # fmt: skip
        strategy.save(state, run_dir / "checkpoints", (), 1)
        barrier()
    finally:
        shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
