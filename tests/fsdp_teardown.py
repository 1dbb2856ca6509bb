"""Groups of two ranks started by tests/test_fsdp2_e2e.py, one after another: each rank a
process of its own (forked from this one, which imported torch and the package once, as
torchrun's variables set), a small model sharded by trainer.strategy=fsdp2, three AdamW
steps, a sharded checkpoint, then what train.py does at its end (every rank meets, then the
group is torn down) and a normal interpreter exit (``sys.exit``: the finalizers and C++
destructors run), where gloo's threads once aborted ("terminate called without an active
exception"). ``python tests/fsdp_teardown.py DIR GROUPS`` exits non-zero naming the first
group whose rank failed, with its stderr."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from helpers.launch import free_port, rank_env
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# once, before the forks: what sharding and saving import on first use (torch._dynamo alone
# takes seconds), so each group's ranks spend their time on what the test is about
import torch._dynamo  # noqa: E402, F401
import torch.distributed.checkpoint  # noqa: E402, F401

from ddp_utils.checkpoint.save import Checkpointer  # noqa: E402
from ddp_utils.config import TrainerConfig  # noqa: E402
from ddp_utils.config.schema import CheckpointOptions  # noqa: E402
from ddp_utils.dist import barrier, init_distributed, shutdown  # noqa: E402
from ddp_utils.strategy import build_strategy  # noqa: E402
from ddp_utils.strategy.fsdp2 import FSDP2Strategy  # noqa: E402, F401


def rank_main(run_dir: Path) -> None:
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
        # in the background (the default), waited for as train.py does at its end
        saver = Checkpointer(CheckpointOptions(), run_dir, rt, keep_last=1)
        saver.save(state, (), strategy.shards_parameters)
        saver.close()
        barrier()
    finally:
        shutdown()


def start_rank(rank: int, port: int, run_dir: Path, err) -> int:
    pid = os.fork()
    if pid:
        return pid
    os.dup2(err.fileno(), 2)
    os.environ.update(rank_env(rank, 2, port))
    try:
        rank_main(run_dir)
    except BaseException:  # never back into the parent's loop: this fork ends here
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)  # the interpreter's own exit, not os._exit


def main(root: Path, groups: int) -> int:
    gc.freeze()  # the forks' collections skip the parent's objects (none of them is garbage)
    for i in range(groups):
        port = free_port()
        errs = [tempfile.TemporaryFile() for _ in range(2)]  # noqa: SIM115
        pids = [start_rank(r, port, root / str(i), errs[r]) for r in range(2)]
        for r, pid in enumerate(pids):
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            errs[r].seek(0)
            err = errs[r].read().decode(errors="replace")
            if code != 0 or "terminate called" in err:
                print(f"group {i} rank {r}: exit {code}\n{err}", file=sys.stderr)
                return 1
        if not (root / str(i) / "checkpoints" / "step_00000003.dcp" / ".metadata").is_file():
            print(f"group {i}: no sharded checkpoint", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
